"""The ``sandbox`` option of the code_sandbox reward: which backend runs the candidate programs.

    rewards:
      code:
        reward_fn: code_sandbox
        reward_kwargs:
          sandbox: {backend: sandbox_fusion, url: "http://10.0.0.5:8080", concurrency: 8}

``parse_sandbox_config`` reads the mapping strictly: an unknown key, a wrong type or a backend not
in ``SANDBOX_BACKENDS`` is one ConfigError naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from roll.configs.errors import ConfigError, did_you_mean

_R = "roll.pipeline.rewards"
# backend name -> "module:Class" taking the SandboxConfig (imported only when chosen).
SANDBOX_BACKENDS: dict[str, str] = {
    "bubblewrap": f"{_R}.sandbox_bwrap:BubblewrapSandbox",
    "sandbox_fusion": f"{_R}.sandbox_fusion:SandboxFusionSandbox",
    "unsafe_local": f"{_R}.sandbox_local:UnsafeLocalSandbox",
}


@dataclass(frozen=True)
class SandboxConfig:
    backend: str = "bubblewrap"
    url: str = ""  # sandbox_fusion: the service's base URL (``POST {url}/run_code``)
    request_timeout_s: float = 30.0  # sandbox_fusion: one HTTP request, on top of the run's time limit
    # How many test cases of one response run at once (processes locally, requests to a service).
    concurrency: int = 1


def parse_sandbox_config(raw: Any, path: str = "sandbox") -> SandboxConfig:
    """A SandboxConfig from the YAML mapping (None: the default, bubblewrap)."""
    if raw is None:
        return SandboxConfig()
    if isinstance(raw, SandboxConfig):
        return raw
    if not isinstance(raw, dict):
        raise ConfigError(path, f"expected a mapping such as {{backend: bubblewrap}}, got {raw!r}")
    names = [f.name for f in fields(SandboxConfig)]
    for key in raw:
        if key not in names:
            raise ConfigError(
                f"{path}.{key}", f"unknown key{did_you_mean(str(key), names)}; keys: {', '.join(names)}"
            )
    config = SandboxConfig(**raw)
    _check_types(config, path)
    return config


def _check_types(config: SandboxConfig, path: str) -> None:
    if config.backend not in SANDBOX_BACKENDS:
        raise ConfigError(
            f"{path}.backend",
            f"unknown sandbox backend {config.backend!r}{did_you_mean(str(config.backend), SANDBOX_BACKENDS)}; "
            f"valid: {', '.join(SANDBOX_BACKENDS)}",
        )
    if not isinstance(config.url, str):
        raise ConfigError(f"{path}.url", f"expected a string, got {config.url!r}")
    if config.backend == "sandbox_fusion" and not config.url.startswith(("http://", "https://")):
        raise ConfigError(
            f"{path}.url", f"sandbox_fusion needs the service's http(s):// URL, got {config.url!r}"
        )
    if config.backend != "sandbox_fusion" and config.url:
        raise ConfigError(f"{path}.url", f"only the sandbox_fusion backend takes a url, not {config.backend}")
    timeout = config.request_timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError(f"{path}.request_timeout_s", f"expected seconds > 0, got {timeout!r}")
    if (
        isinstance(config.concurrency, bool)
        or not isinstance(config.concurrency, int)
        or config.concurrency < 1
    ):
        raise ConfigError(f"{path}.concurrency", f"expected an integer >= 1, got {config.concurrency!r}")
