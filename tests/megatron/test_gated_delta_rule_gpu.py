"""fla's ``chunk_gated_delta_rule`` (the GPU path of Qwen3-Next's linear attention) against roll's
plain-torch chunked delta rule: outputs and input gradients, bf16 inputs, with and without packed
rows. Needs CUDA and flash-linear-attention (``pip install flash-linear-attention``), and a Triton
fla trains with: on the GPU machines (Hopper, Triton < 3.7.1) fla refuses its backward, and the
test checks that roll says so before the forward."""

from __future__ import annotations

import pytest
import torch

from roll.models.megatron.gated_delta_rule import HAVE_FLA, fla_unusable, gated_delta_rule

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not HAVE_FLA, reason="needs flash-linear-attention"),
]


def _inputs(batch: int, seq: int, heads: int = 4, dk: int = 128, dv: int = 128):
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    q, k, v = rand(batch, seq, heads, dk), rand(batch, seq, heads, dk), rand(batch, seq, heads, dv)
    # Log decays in (-0.1, 0) and write strengths in (0, 1), as the layer's softplus/sigmoid make them.
    g = -0.1 * torch.rand(batch, seq, heads, generator=gen, device="cuda")
    beta = torch.rand(batch, seq, heads, generator=gen, device="cuda").to(torch.bfloat16)
    return [t.requires_grad_(True) for t in (q, k, v, g, beta)]


def _run(use_fla: bool, inputs, cu_seqlens=None):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = gated_delta_rule(*leaves, cu_seqlens=cu_seqlens, use_fla=use_fla)
    weight = torch.linspace(-1, 1, out.numel(), device="cuda").reshape(out.shape)
    (out.float() * weight).sum().backward()
    return out.float(), [t.grad.float() for t in leaves]


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    scale = b.abs().max().clamp_min(1e-3)
    err = (a - b).abs().max() / scale
    assert err < 3e-2, f"{what}: max error {err:.3g} of the reference's largest value"


def test_fla_on_a_triton_it_refuses_is_an_error_before_the_forward(monkeypatch) -> None:
    reason = fla_unusable(torch.device("cuda"))
    if reason is None:
        pytest.skip("fla trains with this GPU's Triton")
    monkeypatch.setenv("ROLL_GDN_KERNEL", "fla")
    with pytest.raises(RuntimeError, match="ROLL_GDN_KERNEL=fla: fla refuses its backward"):
        gated_delta_rule(*_inputs(1, 64))


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_fla_kernel_equals_torch_rule(packed: bool) -> None:
    if reason := fla_unusable(torch.device("cuda")):
        pytest.skip(reason)
    if packed:
        inputs = _inputs(1, 300)
        cu = torch.tensor([0, 70, 200, 300], device="cuda")
    else:
        inputs, cu = _inputs(2, 200), None
    out_fla, grads_fla = _run(True, inputs, cu)
    out_torch, grads_torch = _run(False, inputs, cu)
    _close(out_fla, out_torch, "output")
    for name, a, b in zip(("q", "k", "v", "g", "beta"), grads_fla, grads_torch):
        _close(a, b, f"d{name}")
