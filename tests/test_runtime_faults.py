"""Runtime faults through the real launcher on CPU: a worker that dies or hangs inside a stage on
shared devices, and SIGTERM / SIGINT on the driver. Each run is the tiny e2e pipeline (2 colocated
slots) in a subprocess; for worker faults it runs through ``tests/fault_injection.py`` (the
launcher with fault-injecting workers), with ``ROLL_INJECT_FAULT`` in ``system_envs`` making one
worker fail."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from fault_injection import Fault, parse_fault  # noqa: E402
from test_pipeline_e2e import config_dict, write_data  # noqa: E402
from tiny_models import build_tiny_model_dir  # noqa: E402

from roll.pipeline.common.checkpoint import read_state  # noqa: E402
from roll.pipeline.common.signals import (  # noqa: E402
    QUIET_RAY_ERRORS,
    RunInterrupted,
    interruption,
    release_signals,
    take_signals,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("faults")
    model = build_tiny_model_dir(tmp / "model", seed=0)
    write_data(tmp / "train.jsonl", 8)
    write_data(tmp / "val.jsonl", 2, offset=50)
    return tmp, model


def launch(
    tmp: Path, model: Path, name: str, fault: str | None = None, **overrides
) -> tuple[subprocess.Popen, Path]:
    """Start ``examples/start_rlvr_pipeline.py`` on the tiny config (no validation, no checkpoints
    unless asked), or with ``fault`` (a ``ROLL_INJECT_FAULT`` value) ``tests/fault_injection.py``;
    returns the process and its output_dir."""
    if fault is not None:
        overrides["system_envs"] = {**overrides.get("system_envs", {}), "ROLL_INJECT_FAULT": fault}
    out = tmp / name
    train_files = overrides.pop("actor_train_files", None)
    cfg = config_dict(tmp, model, out, **{"max_steps": 1, "save_steps": 0, "eval_steps": 0, **overrides})
    cfg.pop("validation")
    if train_files is not None:
        cfg["actor_train"]["data_args"]["file_name"] = train_files
    (tmp / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    script = REPO / ("tests/fault_injection.py" if fault else "examples/start_rlvr_pipeline.py")
    cmd = [sys.executable, str(script), "--config_name", name]
    proc = subprocess.Popen(
        [*cmd, "--config_path", str(tmp)],
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job has
    )
    return proc, out


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, list[str]]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err.splitlines()


def roll_lines(err: list[str], prefix: str) -> list[str]:
    return [line for line in err if line.startswith(prefix)]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "fault, expected",
    [
        (  # CPU slots: the roles of slot 1 share one process, named with all of them
            "actor_train:1:train_step:exit",
            r"WorkerError: host process pid \d+ on [\d.]+ \(actor_train rank 1, actor_infer rank 1, "
            r"reference rank 1\): ActorDiedError: the worker process died",
        ),
        (
            "reference:0:compute_log_probs:raise",
            r"WorkerError: reference rank 0: RuntimeError: injected fault",
        ),
    ],
    ids=["dies", "raises"],
)
def test_worker_failing_in_a_colocated_stage_is_one_line(tiny, fault, expected):
    tmp, model = tiny
    proc, out = launch(tmp, model, f"dies-{fault.split(':')[0]}", fault=fault)
    code, err = finish(proc)
    assert code == 1, err[-20:]
    assert len(roll_lines(err, "WorkerError")) == 1, err[-20:]
    assert re.match(expected, err[-1]), err[-20:]  # the last line
    assert not any("Traceback" in line for line in err), err[-30:]
    log = (out / "run.log").read_text()
    assert "worker traceback:" in log and "driver traceback:" in log
    assert "Traceback (most recent call last)" in log  # the driver's, and the worker's when it raised
    if fault.endswith("raise"):
        assert 'raise RuntimeError(f"injected fault' in log


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hung_worker_is_named_within_its_timeout(tiny):
    tmp, model = tiny
    proc, _ = launch(
        tmp,
        model,
        "hangs",
        fault="actor_infer:1:generate:hang",
        worker_timeouts={"generate_s": 5},
    )
    code, err = finish(proc)
    assert code == 1, err[-20:]
    assert (
        roll_lines(err, "WorkerTimeout")
        == err[-1:]
        == [
            "WorkerTimeout: actor_infer rank 1: generate did not answer within 5 s (worker_timeouts.generate_s); "
            "the workers were stopped (raise worker_timeouts.generate_s for slower calls)"
        ]
    ), err[-20:]
    assert not any("Traceback" in line for line in err), err[-30:]


def test_a_config_error_inside_the_run_is_one_line_and_stops_the_prestart_while_ray_is_up(
    monkeypatch, capsys
):
    """The data is tokenized after Ray and the host processes have started (prestart): a file of
    only bad rows is a ConfigError there. The hosts must be stopped before Ray shuts down; after it,
    ``ray.kill`` raised ActorHandleNotFoundError, a traceback after the ConfigError line."""
    from roll.configs.errors import ConfigError
    from roll.launch import rlvr as launcher
    from roll.pipeline.rlvr import pipeline

    events = []

    def no_rows(config):
        raise ConfigError("actor_train.data_args.file_name", "no usable prompt rows in ['bad.jsonl']")

    monkeypatch.setattr(pipeline, "run_pipeline", no_rows)
    monkeypatch.setattr(launcher, "discard_prestart", lambda: events.append("stop hosts"))
    monkeypatch.setattr(launcher, "shutdown_ray", lambda grace_s: events.append("stop ray") or True)
    assert launcher.run(object()) == 2
    assert events == ["stop hosts", "stop ray"]
    assert capsys.readouterr().err.splitlines() == [
        "ConfigError: actor_train.data_args.file_name: no usable prompt rows in ['bad.jsonl']"
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_prompt_file_of_only_bad_rows_ends_in_the_config_error_line(tiny):
    """One row of 1 MB (valid JSON, far over prompt_length: it passes the launch checks and is
    dropped when tokenized, with Ray and the hosts already up), one empty, one not JSON."""
    tmp, model = tiny
    bad = tmp / "only_bad.jsonl"
    big = json.dumps({"prompt": "x " * 500_000, "ground_truth": "1", "tag": "arith"})
    bad.write_text(f'{big}\n{{"prompt": " ", "ground_truth": "2"}}\nnot json\n')
    proc, _ = launch(tmp, model, "only-bad-rows", actor_train_files=[str(bad)])
    code, err = finish(proc)
    assert code == 2, err[-20:]
    assert err[-1] == (
        f"ConfigError: actor_train.data_args.file_name: no usable prompt rows in ['{bad}'] (see the warnings above)"
    ), err[-20:]
    assert not any("Traceback" in line or "ActorHandleNotFoundError" in line for line in err), err[-30:]


def worker_pids(mark: str) -> list[int]:
    """Processes whose environment holds ``ROLL_TEST_RUN=<mark>`` (the run's Ray workers)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"ROLL_TEST_RUN={mark}".encode() in (proc / "environ").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "signum, code, group",
    [(signal.SIGTERM, 143, False), (signal.SIGTERM, 143, True), (signal.SIGINT, 130, True)],
    # to the driver (a scheduler), to its process group (`timeout`, systemd: Ray's own processes
    # die too), Ctrl-C (the terminal signals the whole foreground group; Ray ignores SIGINT)
    ids=["SIGTERM-driver", "SIGTERM-group", "SIGINT-group"],
)
def test_signal_stops_workers_and_keeps_the_last_checkpoint(tiny, signum, code, group):
    tmp, model = tiny
    rc, err, took, out, mark = _signal_run(tmp, model, f"signal-{signum}-{group}", signum, group)
    if group and rc == 1 and not any(line.startswith("roll:") for line in err):
        # docs/runtime_faults.md's known limitation: the group's SIGTERM reached the raylet first
        # and Ray's core worker ended the driver ("The connection to the plasma store is failed",
        # exit 1, no line; 2 of 17 runs); one more try must go cleanly.
        rc, err, took, out, mark = _signal_run(tmp, model, f"signal-{signum}-{group}-again", signum, group)
    _check_signal_stop(rc, err, took, out, mark, signum, code)


def _signal_run(tmp: Path, model: Path, name: str, signum: int, group: bool):
    """Run the tiny pipeline to its first checkpoint, signal it; (rc, stderr lines, seconds to exit,
    output_dir, the workers' marker)."""
    mark = uuid.uuid4().hex
    proc, out = launch(tmp, model, name, max_steps=50, save_steps=1, system_envs={"ROLL_TEST_RUN": mark})
    checkpoint = out / "checkpoints" / "step_1"
    deadline = time.monotonic() + 300
    while not (checkpoint / "pipeline_state.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, (
            "the run ended before its first checkpoint"
        )
        time.sleep(0.5)
    assert worker_pids(mark)  # the marker reaches the workers
    sent = time.monotonic()
    if group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    rc, err = finish(proc, timeout=120)
    return rc, err, time.monotonic() - sent, out, mark


def _check_signal_stop(rc, err, took, out, mark, signum, code) -> None:
    checkpoint = out / "checkpoints" / "step_1"
    assert rc == code, err[-20:]
    # `timeout -k 10` kills a driver still running 10 s after its SIGTERM; ray.shutdown alone took
    # 8-10 s when the signal had reached Ray's own processes too (now bounded, ray_shutdown.py).
    assert took < 7, f"the driver took {took:.1f} s to exit after {signal.Signals(signum).name}"
    bad = [i for i, line in enumerate(err) if "Traceback" in line or "SIGTERM received" in line]
    assert not bad, err[bad[0] : bad[0] + 25]  # from the first offending line on
    assert err[-1].startswith(
        f"roll: stopped by {signal.Signals(signum).name}; the workers were stopped; "
        f"last checkpoint: {out / 'checkpoints'}/step_"
    ), err[-10:]
    deadline = time.monotonic() + 20  # killed processes take a moment to be reaped on a busy machine
    while worker_pids(mark) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert worker_pids(mark) == []
    assert read_state(checkpoint)["step"] == 1
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint / "actor_train", out / "weights.pt")
    weights = torch.load(out / "weights.pt", weights_only=False)["model"]
    assert weights and all(torch.isfinite(t).all() for t in weights.values() if torch.is_tensor(t))


@pytest.mark.parametrize(
    "signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"]
)
def test_signals_raise_run_interrupted(signum, code, monkeypatch):
    monkeypatch.delenv(QUIET_RAY_ERRORS, raising=False)
    take_signals()
    try:
        with pytest.raises(KeyboardInterrupt) as info:  # what Ray's waits let through
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the handler raises here, in the main thread
    finally:
        release_signals()  # also cancels the clean-up deadline
    assert isinstance(info.value, RunInterrupted)
    assert os.environ[QUIET_RAY_ERRORS] == "1"  # the killed calls' failures print no tracebacks
    stop = interruption()  # the signal, also when Ray re-raised a plain KeyboardInterrupt
    assert (stop.exit_code, str(stop)) == (code, f"stopped by {signal.Signals(signum).name}")


DIVERTED = """
import os, signal, sys, threading, time
from roll.pipeline.common.signals import RunInterrupted, divert_output_on_signal, take_signals, terminal
take_signals()
print("before the signal", file=sys.stderr, flush=True)
divert_output_on_signal(sys.argv[1])
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
except RunInterrupted:
    pass
print("Traceback (most recent call last): a forwarded worker line", file=sys.stderr)
print("Ray's error message", flush=True)
os.write(2, b"written to fd 2 by C code\\n")
thread = threading.Thread(target=lambda: 1 / 0)
thread.start()
thread.join()
print("roll: stopped by SIGTERM", file=terminal())
"""


def test_after_a_signal_output_goes_to_the_run_log_and_the_last_line_to_the_terminal(tmp_path):
    """What a clean-up shakes loose after a signal (a dying worker's forwarded traceback, a thread's
    exception, C code writing to fd 2, Ray's messages on stdout) lands in run.log, not around the
    one line."""
    log = tmp_path / "run.log"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", DIVERTED, str(log)], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == ["before the signal", "roll: stopped by SIGTERM"]
    assert proc.stdout == ""
    kept = log.read_text()
    for line in ("a forwarded worker line", "Ray's error message", "written to fd 2", "ZeroDivisionError"):
        assert line in kept, kept


def test_fault_spec_names_the_variable_when_malformed():
    assert parse_fault("rewards.math:0:compute_rewards:hang") == Fault(
        "rewards.math", 0, "compute_rewards", "hang"
    )
    with pytest.raises(ValueError, match="^ROLL_INJECT_FAULT='actor_train:x:train_step:exit': expected"):
        parse_fault("actor_train:x:train_step:exit")
    with pytest.raises(ValueError, match="action one of \\['exit', 'hang', 'raise'\\]"):
        parse_fault("actor_train:0:train_step:explode")
