"""roll's one-gather thd RoPE equals megatron-core's per-sequence loop, values and gradients."""

from __future__ import annotations

import pytest
import torch

rope_utils = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")

from roll.models.megatron import thd_rope  # noqa: E402


class _Group:
    def __init__(self, size: int = 1) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


def _original():
    thd_rope.install()
    return thd_rope._ORIGINAL["thd"]


@pytest.mark.parametrize("freq_len", ["max_seqlen", "row"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_one_gather_equals_megatrons_loop(freq_len: str, interleaved: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 6, 13, 20], dtype=torch.int32)
    total, heads, dim = 20, 3, 16
    longest = int((cu[1:] - cu[:-1]).max())
    freqs = torch.randn(longest if freq_len == "max_seqlen" else total, 1, 1, dim, generator=gen)
    t = torch.randn(total, heads, dim, generator=gen)
    a, b = t.clone().requires_grad_(True), t.clone().requires_grad_(True)
    want = _original()(a, cu, freqs, interleaved, False, 1.0, _Group())
    got = thd_rope.apply_thd(b, cu, freqs, interleaved, False, 1.0, _Group())
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    weights = torch.randn(total, heads, dim, generator=gen)
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0)


def test_install_routes_megatron() -> None:
    assert thd_rope.install() and rope_utils._apply_rotary_pos_emb_thd is thd_rope.apply_thd
    assert thd_rope.install()  # idempotent


def test_context_parallel_keeps_megatrons_function(monkeypatch) -> None:
    calls = []
    thd_rope.install()
    monkeypatch.setitem(thd_rope._ORIGINAL, "thd", lambda *args: calls.append(args) or "megatron")
    t = torch.zeros(4, 1, 8)
    assert (
        thd_rope.apply_thd(t, torch.tensor([0, 4]), torch.zeros(4, 1, 1, 8), cp_group=_Group(2)) == "megatron"
    )
    assert len(calls) == 1


def test_positions_are_computed_once_per_row(monkeypatch) -> None:
    calls = []
    real = thd_rope.packed_positions
    monkeypatch.setattr(
        thd_rope, "packed_positions", lambda cu, total: calls.append(total) or real(cu, total)
    )
    cu, other = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 4, 8], dtype=torch.int32)
    freqs = torch.randn(5, 1, 1, 8)
    t = torch.randn(8, 2, 8)
    first = thd_rope.apply_thd(t, cu, freqs, cp_group=_Group())
    assert torch.equal(thd_rope.apply_thd(t, cu, freqs, cp_group=_Group()), first)  # the same row again
    assert calls == [8]
    thd_rope.apply_thd(t, other, freqs, cp_group=_Group())  # a new row (new tensor) is recomputed
    assert calls == [8, 8]
