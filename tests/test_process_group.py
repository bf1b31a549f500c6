"""``init_default_group``: the one place a roll process joins torch.distributed's default group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from roll.utils.process_group import init_default_group


@pytest.fixture
def no_group(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert not dist.is_initialized()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_single_rank_makes_its_own_group_then_checks_it(no_group):
    cpu = torch.device("cpu")
    assert init_default_group(0, 1, cpu, who="actor_train") is True
    assert dist.get_backend() == "gloo" and dist.get_world_size() == 1
    assert init_default_group(0, 1, cpu, who="actor_train") is False  # already in it: checked only
    with pytest.raises(
        RuntimeError,
        match="^critic: the default process group is rank 0 of 1, but this process is rank 1 of 2",
    ):
        init_default_group(1, 2, cpu, who="critic")


def test_several_ranks_need_a_rendezvous(no_group):
    with pytest.raises(RuntimeError, match="^reference: 2 ranks need MASTER_ADDR and MASTER_PORT"):
        init_default_group(0, 2, torch.device("cpu"), who="reference")
