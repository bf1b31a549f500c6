"""The ``sandbox_fusion`` backend: run programs on a SandboxFusion service (the one verl users run).

    sandbox = SandboxFusionSandbox(SandboxConfig(backend="sandbox_fusion", url="http://127.0.0.1:8080"))
    sandbox.run("print(int(input()) * 2)", "21", Limits())  # SandboxResult(0, '42\\n', ...)

One ``POST {url}/run_code`` per program with ``{"code", "language": "python", "stdin",
"run_timeout", "compile_timeout", "memory_limit_MB"}``; the answer's ``run_result`` gives
``status`` ("Finished", "TimeLimitExceeded", ...), ``return_code`` and ``stdout``. The service does
the isolation. At most ``config.concurrency`` requests of this process are in flight at once.

The service failing is a reward failure, not a wrong program: a connection error, an HTTP error, an
answer that is not the API's JSON, or ``status: SandboxError`` raises ``SandboxError`` naming the URL.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from roll.pipeline.rewards.sandbox_config import SandboxConfig
from roll.pipeline.rewards.sandbox_types import Limits, SandboxError, SandboxResult

MAX_MESSAGE = 200


class SandboxFusionSandbox:
    def __init__(self, config: SandboxConfig):
        self.endpoint = config.url.rstrip("/") + "/run_code"
        self.request_timeout_s = float(config.request_timeout_s)
        self.slots = threading.BoundedSemaphore(config.concurrency)

    @staticmethod
    def unavailable_reason() -> None:
        return None  # the service may start after the launch; a request that fails names the URL

    def run(self, code: str, stdin: str, limits: Limits) -> SandboxResult:
        body = {
            "code": code,
            "language": "python",
            "stdin": stdin,
            "run_timeout": limits.time_limit_s,
            "compile_timeout": limits.time_limit_s,
            "memory_limit_MB": limits.memory_mb,
        }
        start = time.monotonic()
        with self.slots:
            answer = self._post(body, limits.time_limit_s + self.request_timeout_s)
        return self._result(answer, limits, time.monotonic() - start)

    def _post(self, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        request = urllib.request.Request(
            self.endpoint, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            raise SandboxError(
                f"sandbox_fusion {self.endpoint}: HTTP {exc.code} {_short(exc.read())}"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise SandboxError(
                f"sandbox_fusion {self.endpoint}: cannot reach the service: {reason}"
            ) from None
        try:
            answer = json.loads(raw)
        except ValueError:
            raise SandboxError(f"sandbox_fusion {self.endpoint}: answer is not JSON: {_short(raw)}") from None
        if not isinstance(answer, dict) or "status" not in answer:
            raise SandboxError(f"sandbox_fusion {self.endpoint}: answer has no status: {_short(raw)}")
        return answer

    def _result(self, answer: dict[str, Any], limits: Limits, seconds: float) -> SandboxResult:
        if answer["status"] == "SandboxError":
            raise SandboxError(
                f"sandbox_fusion {self.endpoint}: SandboxError: {_short(answer.get('message', ''))}"
            )
        run = answer.get("run_result")
        if not isinstance(run, dict):  # e.g. status "Failed" before the program ran
            return SandboxResult(1, "", False, seconds)
        stdout = str(run.get("stdout") or "")[: limits.output_bytes]
        if run.get("status") == "TimeLimitExceeded":
            return SandboxResult(None, stdout, True, seconds)
        code = run.get("return_code")
        finished = run.get("status") == "Finished" and isinstance(code, int)
        return SandboxResult(code if finished else 1, stdout, False, seconds)


def _short(text: Any) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."
