"""``SGLangEngineCalls``: the control calls ``SGLangStrategy`` makes into ``sglang.Engine``, one
method each.

SGLang answers a control call with ``(success, message)`` (or an object with ``success``); each
method here makes its one engine call with the arguments roll always passes and turns a failure
into a ``RuntimeError`` naming the call, so the strategy reads as what it asks for::

    calls = SGLangEngineCalls(engine)
    calls.update_weights_from_tensor(named)      # Engine.update_weights_from_tensor(..., flush_cache=False)
    calls.release_memory(["kv_cache"])           # Engine.release_memory_occupation(tags=[...])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from roll.distributed.strategy.sglang_weight_names import sglang_weight_names


class SGLangEngineCalls:
    """Typed control calls on one ``sglang.Engine`` (generation calls stay in the strategy).
    ``rename``: roll's weight names into the ones the engine's model loads
    (``sglang_weight_names``), applied to every weight update."""

    def __init__(self, engine: Any, rename: Callable[[str], str] = sglang_weight_names(None)) -> None:
        self.engine = engine
        self.rename = rename

    def release_memory(self, tags: list[str]) -> None:
        _ok(self.engine.release_memory_occupation(tags=tags), "release_memory_occupation")

    def resume_memory(self, tags: list[str]) -> None:
        _ok(self.engine.resume_memory_occupation(tags=tags), "resume_memory_occupation")

    def flush_cache(self) -> None:
        self.engine.flush_cache()

    def abort(self, rid: str) -> None:
        """Posted onto the engine's event loop: safe from a thread other than the one generating."""
        self.engine.loop.call_soon_threadsafe(self.engine.tokenizer_manager.abort_request, rid)

    def update_weights_from_tensor(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Full HF-named tensors (CUDA ones cross to the schedulers by IPC); the radix cache is
        flushed by the caller once the KV cache is back."""
        _ok(
            self.engine.update_weights_from_tensor(
                named_tensors=[(self.rename(name), tensor) for name, tensor in named], flush_cache=False
            ),
            "update_weights_from_tensor",
        )

    def init_weights_update_group(
        self, host: str, port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        result = self.engine.init_weights_update_group(
            master_address=host,
            master_port=port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        _ok(result, "init_weights_update_group")

    def update_weights_from_distributed(self, meta: Any, group_name: str) -> None:
        """One bucket's tensors, broadcast on SGLang's group as one flat buffer of them back to back
        in ``meta``'s order (``load_format="flattened_bucket"``); returns once loaded."""
        result = self.engine.update_weights_from_distributed(
            names=[self.rename(t.name) for t in meta.tensors],
            dtypes=[str(t.dtype).removeprefix("torch.") for t in meta.tensors],
            shapes=[list(t.shape) for t in meta.tensors],
            group_name=group_name,
            flush_cache=False,
            load_format="flattened_bucket",
        )
        _ok(result, f"update_weights_from_distributed of bucket {meta.index} on {group_name!r}")


def _ok(result: Any, call: str) -> None:
    """SGLang answers control calls with ``(success, message)`` (or an object with ``success``)."""
    if isinstance(result, tuple) and result and result[0] is False:
        raise RuntimeError(f"SGLang {call} failed: {result[1] if len(result) > 1 else ''}")
    if getattr(result, "success", True) is False:
        raise RuntimeError(f"SGLang {call} failed: {getattr(result, 'message', '')}")
