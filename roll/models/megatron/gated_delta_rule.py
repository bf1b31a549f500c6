"""The gated delta rule of Gated DeltaNet (Qwen3-Next's linear attention) and its causal
convolution, in plain torch, with flash-linear-attention's kernel where it serves.

Per value head, with a recurrent state ``S`` [key_dim, value_dim] that starts at zero for every
sequence: ``S <- exp(g_t) S``; ``S <- S + k_t (beta_t (v_t - S^T k_t))^T``; ``o_t = S^T q_t``, where
``q`` and ``k`` are L2-normalised (in fp32) and ``q`` is scaled by ``key_dim ** -0.5``.

``gated_delta_rule`` runs ``chunked_delta_rule`` by default: the same recurrence
over chunks of 64 tokens (within a chunk the delta-rule updates are one unit-triangular solve,
between chunks the state is carried), all in fp32, differentiable by autograd. Packed rows
(``cu_seqlens``) restart the state at every sequence start. fla's ``chunk_gated_delta_rule``
(Triton, CUDA only) runs instead with ``ROLL_GDN_KERNEL=fla`` where fla is importable and the
tensors are on a GPU. It is not the default: on Hopper, fla 0.6 refuses its backward with Triton
>= 3.4.0 and < 3.7.1 (incorrect gradients, fla issue #640), which is what the GPU machines have
(tests/megatron/test_gated_delta_rule_gpu.py, 2026-11-28); asking for it there raises before the
first step's backward rather than in it (``fla_unusable``).

>>> out = gated_delta_rule(q, k, v, g, beta)              # [b, s, heads, dim] in, [b, s, hv, dv] out
>>> x = causal_conv(x, weight, cu_seqlens=None)           # depthwise causal conv1d + SiLU
"""

from __future__ import annotations

import importlib.util
import os

import torch
import torch.nn.functional as F

HAVE_FLA = importlib.util.find_spec("fla") is not None
CHUNK = 64
L2_EPS = 1e-6  # fla's and transformers' epsilon of the q/k L2 norm


# Triton versions whose gated chunk backward fla 0.6 refuses on Hopper (fla issue #640).
FLA_BAD_TRITON_ON_HOPPER = ((3, 4, 0), (3, 7, 1))


def fla_unusable(device: torch.device) -> str | None:
    """Why fla's kernel cannot train on ``device`` (None: it can): fla 0.6's own check, made before
    the forward instead of inside the first backward."""
    try:
        import triton
    except ImportError:
        return "fla needs Triton"
    version = tuple(int(part) for part in triton.__version__.split("+")[0].split(".")[:3] if part.isdigit())
    low, high = FLA_BAD_TRITON_ON_HOPPER
    if torch.cuda.get_device_capability(device)[0] == 9 and low <= version < high:
        return (
            f"fla refuses its backward on Hopper with Triton {triton.__version__} (incorrect gradients "
            "with Triton >= 3.4.0 and < 3.7.1, fla issue #640)"
        )
    return None


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, as fla and transformers compute it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def segments(total: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int]]:
    """[start, stop) of each packed sequence of a row of ``total`` tokens (one segment when not
    packed); padding after the last sequence is a segment of its own, so no token is dropped."""
    if cu_seqlens is None:
        return [(0, total)]
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[-1] < total:
        bounds.append(total)
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """Depthwise causal convolution of ``x`` [b, channels, s] with ``weight`` [channels, 1, kernel]
    (zero history before each sequence), then SiLU; computed in the weight's dtype."""
    kernel = weight.shape[-1]

    def conv(part: torch.Tensor) -> torch.Tensor:
        out = F.conv1d(part.to(weight.dtype), weight, padding=kernel - 1, groups=part.shape[1])
        return F.silu(out[..., : part.shape[-1]])

    parts = [conv(x[..., a:b]) for a, b in segments(x.shape[-1], cu_seqlens)]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).to(x.dtype)


def _chunks(x: torch.Tensor, pad: int) -> torch.Tensor:
    """[b, h, s, ...] -> [b, h, n, CHUNK, ...], zero-padded at the end."""
    if x.dim() == 3:
        return F.pad(x, (0, pad)).unflatten(2, (-1, CHUNK))
    return F.pad(x, (0, 0, 0, pad)).unflatten(2, (-1, CHUNK))


def chunked_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """The gated delta rule over one sequence per batch row, fp32 [b, h, s, d] (q, k normalised
    and q scaled), ``g``/``beta`` [b, h, s]; returns [b, h, s, dv].

    Within a chunk, with the state ``S0`` at its start and ``G`` the cumulative log decay, the
    state corrections ``D`` solve ``(I + A) D = beta v - (beta k exp(G)) S0`` where
    ``A[t, j] = beta_t (k_t . k_j) exp(G_t - G_j)`` for ``j < t``; then
    ``o = exp(G) q S0 + ((q k^T) * decay) D`` and ``S = exp(G_last) S0 + (k exp(G_last - G))^T D``.
    Padding tokens (zero ``k``, ``beta`` and ``g``) change neither the outputs nor the state."""
    seq = q.shape[2]
    pad = (-seq) % CHUNK
    q, k, v, g, beta = (_chunks(t, pad) for t in (q, k, v, g, beta))
    cum = g.cumsum(dim=-1)  # [b, h, n, c]
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    eye = torch.eye(CHUNK, dtype=q.dtype, device=q.device)
    system = (k_beta @ k.transpose(-1, -2) * decay).tril(-1) + eye  # I + A, unit lower-triangular
    values = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    keys = torch.linalg.solve_triangular(
        system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    scores = q @ k.transpose(-1, -2) * decay
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    state = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1])
    outputs = []
    for i in range(q.shape[2]):
        delta = values[:, :, i] - keys[:, :, i] @ state
        outputs.append(q_decayed[:, :, i] @ state + scores[:, :, i] @ delta)
        state = state * cum[:, :, i, -1, None, None].exp() + k_to_end[:, :, i].transpose(-1, -2) @ delta
    return torch.stack(outputs, dim=2).flatten(2, 3)[:, :, :seq]


def _torch_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
) -> torch.Tensor:
    """[b, s, h, d] inputs (q, k already repeated to the value heads) through ``chunked_delta_rule``."""
    dtype = v.dtype
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    q = q * q.shape[-1] ** -0.5
    q, k, v = (t.float().transpose(1, 2) for t in (q, k, v))
    g, beta = (t.float().transpose(1, 2) for t in (g, beta))
    parts = [
        chunked_delta_rule(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], g[:, :, a:b], beta[:, :, a:b])
        for a, b in segments(q.shape[2], cu_seqlens)
    ]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return out.transpose(1, 2).to(dtype)


def _fla_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
) -> torch.Tensor:
    """fla's Triton kernel (CUDA): q/k L2-normalised inside it, the state restarting per sequence."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    if cu_seqlens is not None:
        bounds = torch.tensor([a for a, _ in segments(q.shape[1], cu_seqlens)] + [q.shape[1]])
        cu_seqlens = bounds.to(device=q.device, dtype=torch.long)
    out, _ = chunk_gated_delta_rule(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        g=g.contiguous(),
        beta=beta.contiguous(),
        initial_state=None,
        output_final_state=False,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=True,
    )
    return out


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    use_fla: bool | None = None,
) -> torch.Tensor:
    """Outputs [b, s, hv, dv] for ``q``/``k`` [b, s, hv, dk] (repeated to the value heads),
    ``v`` [b, s, hv, dv], log decays ``g`` and ``beta`` [b, s, hv]; ``cu_seqlens`` (packed rows, b
    = 1) restarts the state per sequence. ``use_fla`` None: fla's kernel where ``ROLL_GDN_KERNEL=fla``
    is set, fla is installed and the tensors are on a GPU; the torch rule otherwise."""
    if use_fla is None:
        use_fla = os.environ.get("ROLL_GDN_KERNEL") == "fla" and HAVE_FLA and q.is_cuda
    if use_fla and (reason := fla_unusable(q.device)):
        raise RuntimeError(f"ROLL_GDN_KERNEL=fla: {reason}; unset it to use roll's torch rule")
    rule = _fla_rule if use_fla else _torch_rule
    return rule(q, k, v, g, beta, cu_seqlens)
