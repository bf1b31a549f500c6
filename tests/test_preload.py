"""roll/utils/preload.py: an engine's import starts on a background thread when a GPU worker is
built, and create_strategy waits for it."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from roll.distributed.executor.worker import Worker
from roll.utils.preload import preload
from roll.utils.start_marks import StartMarks


def test_preload_imports_installed_modules_on_a_thread_and_skips_missing_ones(tmp_path, monkeypatch):
    (tmp_path / "roll_preload_probe.py").write_text("import time\ntime.sleep(0.2)\nLOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "roll_preload_probe", raising=False)
    thread = preload(["roll_preload_probe", "roll_no_such_module_xyz"])
    assert thread is not None and thread.daemon
    thread.join(timeout=30)
    assert sys.modules["roll_preload_probe"].LOADED
    assert preload(["roll_no_such_module_xyz"]) is None  # nothing installed: no thread


def test_a_failing_preload_leaves_the_error_to_the_strategys_own_import(tmp_path, monkeypatch):
    (tmp_path / "roll_preload_broken.py").write_text("raise RuntimeError('broken engine')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    thread = preload(["roll_preload_broken"])
    thread.join(timeout=30)  # the thread logs and ends; nothing raised here
    assert "roll_preload_broken" not in sys.modules


def test_create_strategy_waits_for_the_preload(monkeypatch):
    order = []

    class Thread:
        def join(self):
            order.append("joined")

    worker = Worker.__new__(Worker)
    worker._preloading = Thread()
    worker.start_marks = StartMarks()
    worker.role = "actor_infer"
    worker.role_config = SimpleNamespace(strategy_args=SimpleNamespace(strategy_name="hf_infer"))
    worker.ctx = None
    monkeypatch.setattr(
        "roll.distributed.executor.worker.load_strategy_class",
        lambda name, path: lambda cfg, ctx: order.append("built") or "strategy",
    )
    worker.create_strategy()
    assert order == ["joined", "built"] and worker._preloading is None and worker.strategy == "strategy"
    assert "imports_wait" in worker.start_marks.spans  # the start-up timeline's wait for the preload


def test_every_strategys_preload_names_a_module_of_its_installed_package():
    """A misspelled preload name would only log a warning on GPU workers: check the names here,
    for each strategy whose package this machine has (megatron-core on CI; vLLM/SGLang not)."""
    import importlib.util

    from roll.configs.strategies import STRATEGIES

    checked = 0
    for spec in STRATEGIES.values():
        for module in spec.preload:
            if importlib.util.find_spec(module.split(".")[0]) is None:
                continue
            assert importlib.util.find_spec(module) is not None, f"{spec.name}: preload {module!r}"
            checked += 1
    assert checked >= 2  # the megatron strategies' modules, at least
