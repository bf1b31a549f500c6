"""The code reward's ``sandbox`` option: strict parsing, and the pre-launch check that refuses a
machine without the bubblewrap sandbox in one line unless the config says unsafe_local."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from roll.configs.errors import ConfigError
from roll.launch.files import check_reward_options
from roll.pipeline.rewards import sandbox_bwrap
from roll.pipeline.rewards.sandbox_bwrap import BubblewrapSandbox, SandboxUnavailable
from roll.pipeline.rewards.sandbox_config import SandboxConfig, parse_sandbox_config

MISSING = "bubblewrap (bwrap) is not installed: apt-get install bubblewrap (dnf install bubblewrap)"


def config_with(sandbox: object) -> SimpleNamespace:
    reward = SimpleNamespace(
        reward_fn="code_sandbox", reward_kwargs={"reward_type": "hard", "sandbox": sandbox}
    )
    return SimpleNamespace(rewards={"code": reward})


@pytest.mark.parametrize(
    ("raw", "key", "message"),
    [
        ({"backend": "bubblewrap", "concurency": 2}, "sandbox.concurency", "did you mean 'concurrency'"),
        ({"backend": "docker"}, "sandbox.backend", "valid: bubblewrap, sandbox_fusion, unsafe_local"),
        ({"backend": "sandbox_fusion"}, "sandbox.url", "needs the service's http\\(s\\)://"),
        ({"backend": "bubblewrap", "url": "http://x"}, "sandbox.url", "only the sandbox_fusion backend"),
        ({"concurrency": 0}, "sandbox.concurrency", "expected an integer >= 1"),
        (
            {"backend": "sandbox_fusion", "url": "http://x", "request_timeout_s": "5"},
            "sandbox.request_timeout_s",
            "expected seconds > 0",
        ),
        ("unsafe_local", "sandbox", "expected a mapping"),
    ],
)
def test_bad_options_name_the_key(raw, key, message):
    with pytest.raises(ConfigError, match=message) as err:
        parse_sandbox_config(raw, "sandbox")
    assert err.value.path == key


def test_defaults_to_bubblewrap():
    assert parse_sandbox_config(None) == SandboxConfig(backend="bubblewrap")
    fusion = parse_sandbox_config(
        {"backend": "sandbox_fusion", "url": "http://10.0.0.5:8080", "concurrency": 8}
    )
    assert fusion.concurrency == 8 and fusion.url == "http://10.0.0.5:8080"


def test_launch_refuses_a_machine_without_the_sandbox_in_one_line(monkeypatch):
    monkeypatch.setattr(sandbox_bwrap, "unavailable_reason", lambda: MISSING)
    for sandbox in (None, {"backend": "bubblewrap"}):
        with pytest.raises(ConfigError) as err:
            check_reward_options(config_with(sandbox))
        assert err.value.path == "rewards.code.reward_kwargs.sandbox.backend"
        assert "apt-get install bubblewrap" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        BubblewrapSandbox(SandboxConfig())  # a worker on such a machine never runs a program either


def test_unsafe_local_is_an_explicit_choice_that_warns(monkeypatch, caplog):
    monkeypatch.setattr(sandbox_bwrap, "unavailable_reason", lambda: MISSING)
    with caplog.at_level(logging.WARNING):
        check_reward_options(config_with({"backend": "unsafe_local"}))
    assert "WITHOUT isolation" in caplog.text


def test_launch_checks_the_sandbox_keys():
    with pytest.raises(ConfigError) as err:
        check_reward_options(config_with({"backend": "sandbox_fusion", "url": "http://x", "timeout": 3}))
    assert err.value.path == "rewards.code.reward_kwargs.sandbox.timeout"
