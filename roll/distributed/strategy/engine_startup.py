"""Starting an inference engine inside a worker, the same way for ``vllm`` and ``sglang``.

Both strategies import their engine (a ConfigError naming the pip extra when it is missing), build
its options with the worker's seed (``ctx.seed + ctx.rank``), check every option against the
installed engine's argument class, construct the engine and read the pad token id. What differs
is a row of ``ENGINES``::

    started = start_engine(ENGINES["vllm"], lambda seed: vllm_engine_options(..., seed, EXT), role_config, ctx)
    llm, vllm = started.engine, started.module
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from roll.distributed.strategy.engine_options import EngineOptions, dataclass_field_names, import_engine
from roll.models.tokenizer import load_tokenizer
from roll.utils.start_marks import init_span

if TYPE_CHECKING:
    from roll.configs.role import RoleConfig
    from roll.core.worker_context import WorkerContext


@dataclass(frozen=True)
class EngineKind:
    package: str  # the Python package, which is also the strategy's name and its pip extra
    display: str  # how errors name the engine
    args_class: str  # "module:Class" of the option dataclass the options are checked against
    constructor: str  # the engine class in ``package``


ENGINES = {
    "vllm": EngineKind("vllm", "vLLM", "vllm.engine.arg_utils:EngineArgs", "LLM"),
    "sglang": EngineKind("sglang", "SGLang", "sglang.srt.server_args:ServerArgs", "Engine"),
}


@dataclass(frozen=True)
class StartedEngine:
    module: ModuleType  # the engine's package (vLLM's strategy builds SamplingParams from it)
    engine: Any  # ``vllm.LLM`` / ``sglang.Engine``
    pad_token_id: int | None


def accepted_options(kind: EngineKind) -> set[str]:
    """The option names the installed engine's argument class takes (imports the engine)."""
    args_module, args_class = kind.args_class.split(":")
    return dataclass_field_names(getattr(importlib.import_module(args_module), args_class))


def declared_options(kind: EngineKind) -> set[str] | None:
    """The option names of the engine's argument class without importing the engine (``import
    vllm`` takes ~12 s on a GPU host, which a check before launch must not pay): from the class if
    its module is already imported, else from the annotated fields in the installed source. None
    when neither can say (not installed here, or a class whose fields are not all in its own body):
    the worker's check at engine start (``accepted_options``) then decides."""
    args_module, args_class = kind.args_class.split(":")
    if args_module in sys.modules:
        return accepted_options(kind)
    top, *rest = args_module.split(".")
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: finds without importing
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations)), *rest[:-1], f"{rest[-1]}.py") if rest else None
    if source is None or not source.is_file():
        return None
    fields = _annotated_fields(source, args_class)
    return set(fields) if fields is not None else None


@functools.cache
def _annotated_fields(source: Path, class_name: str) -> frozenset[str] | None:
    """The annotated names in the body of class ``class_name`` of ``source`` (read and parsed once
    per launch, however many roles use the engine); None when the class is absent or has bases."""
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            if node.bases:
                return None
            items = (item for item in node.body if isinstance(item, ast.AnnAssign))
            return frozenset(item.target.id for item in items if isinstance(item.target, ast.Name))
    return None


def start_engine(
    kind: EngineKind,
    options: Callable[[int], EngineOptions],
    role_config: RoleConfig,
    ctx: WorkerContext,
    engine_class: Callable[[ModuleType], Callable[..., Any]] | None = None,
) -> StartedEngine:
    """Import, check and construct the engine ``kind`` with ``options(seed)``. The options are
    also checked before launch where the driver imports the engine (roll.launch.roles); here for
    drivers without it: only this process is sure to have the engine that will run.
    ``engine_class(module)`` picks the class to construct (``kind.constructor`` by default)."""
    with init_span(f"{kind.package}.import"):  # what the worker's preload has not done yet
        module = import_engine(kind.package, ctx.role, kind.package)
    built = options(ctx.seed + ctx.rank)
    built.check(accepted_options(kind), kind.display, kind.package)
    with init_span(f"{kind.package}.engine"):
        constructor = engine_class(module) if engine_class else getattr(module, kind.constructor)
        engine = constructor(**built.kwargs)
    margs = role_config.model_args
    pad_token_id = load_tokenizer(margs.model_name_or_path, margs.trust_remote_code).pad_token_id
    return StartedEngine(module, engine, pad_token_id)
