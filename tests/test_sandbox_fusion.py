"""The sandbox_fusion backend against a stand-in SandboxFusion server on 127.0.0.1 (stdlib http.server):
the request it sends, how answers map to results, the concurrency bound, and service failures that
must count as reward failures naming the URL."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from roll.pipeline.rewards.code_sandbox import code_sandbox_reward
from roll.pipeline.rewards.sandbox import Limits, SandboxConfig, SandboxError
from roll.pipeline.rewards.sandbox_fusion import SandboxFusionSandbox

DOUBLE = json.dumps([{"input": str(n), "output": str(2 * n)} for n in range(6)])


class StandIn(ThreadingHTTPServer):
    """Answers POST /run_code like SandboxFusion, running the (trusted, test-written) code locally."""

    daemon_threads = True

    def __init__(self, reply: str = "run", delay_s: float = 0.0):
        super().__init__(("127.0.0.1", 0), Handler)
        self.reply, self.delay_s = reply, delay_s
        self.requests: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: StandIn

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requests.append({"path": self.path, **body})
            self.server.in_flight += 1
            self.server.max_in_flight = max(self.server.max_in_flight, self.server.in_flight)
        try:
            time.sleep(self.server.delay_s)
            self._answer(body)
        finally:
            with self.server.lock:
                self.server.in_flight -= 1

    def _answer(self, body: dict) -> None:
        if self.server.reply == "http500":
            self.send_error(500, "internal")
            return
        if self.server.reply == "sandbox_error":
            answer = {"status": "SandboxError", "message": "no runner available", "run_result": None}
        else:
            answer = _run(body)
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def _run(body: dict) -> dict:
    try:
        done = subprocess.run(
            [sys.executable, "-c", body["code"]], input=body["stdin"], capture_output=True, text=True,
            timeout=body["run_timeout"],
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        run = {"status": "TimeLimitExceeded", "return_code": None, "stdout": "", "stderr": ""}
        return {"status": "Failed", "message": "", "run_result": run}
    run = {"status": "Finished", "return_code": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
    return {"status": "Success" if done.returncode == 0 else "Failed", "message": "", "run_result": run}


@pytest.fixture
def server(request):
    stand_in = StandIn(*getattr(request, "param", ()))
    thread = threading.Thread(target=stand_in.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield stand_in
    stand_in.shutdown()
    stand_in.server_close()


def fusion(url: str, **extra: object) -> dict:
    return {"backend": "sandbox_fusion", "url": url, **extra}


def test_scores_through_the_service_and_sends_the_api_fields(server):
    good = "```python\nprint(int(input()) * 2)\n```"
    assert code_sandbox_reward(good, DOUBLE, sandbox=fusion(server.url), time_limit_s=3.0) == 1.0
    assert code_sandbox_reward("print(0)", DOUBLE, sandbox=fusion(server.url)) == pytest.approx(1 / 6)
    first = server.requests[0]
    assert first["path"] == "/run_code" and first["language"] == "python"
    assert first["code"] == "print(int(input()) * 2)\n" and first["stdin"] == "0"
    assert first["run_timeout"] == 3.0 and first["memory_limit_MB"] == 512


def test_time_limit_and_exit_codes_map_to_results(server):
    sandbox = SandboxFusionSandbox(SandboxConfig(**fusion(server.url)))
    slow = sandbox.run("import time\ntime.sleep(5)", "", Limits(time_limit_s=0.5))
    assert slow.timed_out and not slow.ok
    failed = sandbox.run("print('partial')\nraise SystemExit(3)", "", Limits())
    assert failed.returncode == 3 and failed.stdout == "partial\n" and not failed.ok
    cut = sandbox.run("print('x' * 100)", "", Limits(output_bytes=10))
    assert cut.ok and cut.stdout == "x" * 10


@pytest.mark.parametrize("server", [("run", 0.2)], indirect=True)
def test_concurrency_bounds_requests_in_flight(server):
    sandbox = fusion(server.url, concurrency=2)
    assert code_sandbox_reward("print(int(input()) * 2)", DOUBLE, sandbox=sandbox) == 1.0
    assert len(server.requests) == 6 and server.max_in_flight == 2


def test_an_unreachable_service_is_a_failure_naming_the_url():
    with StandIn() as closed:
        url = closed.url  # bound, never served, then closed: nothing listens there
    with pytest.raises(SandboxError, match=f"{url}/run_code: cannot reach the service"):
        code_sandbox_reward("print(1)", DOUBLE, sandbox=fusion(url, request_timeout_s=2.0))


@pytest.mark.parametrize(
    ("server", "message"),
    [(("sandbox_error",), "SandboxError: no runner available"), (("http500",), "HTTP 500")],
    indirect=["server"],
)
def test_service_errors_are_failures_not_wrong_programs(server, message):
    with pytest.raises(SandboxError, match=f"{server.url}/run_code: {message}"):
        code_sandbox_reward("print(1)", DOUBLE, sandbox=fusion(server.url))
