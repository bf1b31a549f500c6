"""Per-token KL estimators between the policy and the reference, from sampled-token log-probs.

Every estimator takes ``log_probs`` (policy, log pi) and ``ref_log_probs`` (reference, log pi_ref)
of the sampled tokens, both ``[B, R]``, and returns a ``[B, R]`` estimate of KL(pi || pi_ref) at
each token (Schulman, "Approximating KL divergence", 2020). With ``d = log_probs - ref_log_probs``:

==================  ==========================================  =========================================
name                formula                                      note
==================  ==========================================  =========================================
``kl`` / ``k1``     ``d``                                       unbiased, can be negative
``abs``             ``|d|``
``mse`` / ``k2``    ``0.5 * d**2``                              biased, low variance, >= 0
``low_var_kl``/k3   ``exp(-d) - 1 + d``, clamped to [-10, 10]   unbiased, >= 0; clamp guards exp overflow
``full``            needs full vocabulary distributions         refused (``KL_REFUSED``): not computable here
==================  ==========================================  =========================================

Used twice: as a reward penalty (``kl_penalty``, ``init_kl_coef``, ``add_token_level_kl``) and as
a loss term (``kl_loss_type``, ``kl_loss_coef``, ``use_kl_loss``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# k3 = exp(-d) - 1 + d explodes for large |d|; clamping to +-10 follows the literature (verl, ROLL).
LOW_VAR_KL_BOUND = 10.0


def kl_k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return log_probs - ref_log_probs


def kl_abs(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return (log_probs - ref_log_probs).abs()


def kl_k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_probs - ref_log_probs).square()


def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    log_ratio = ref_log_probs - log_probs  # log(pi_ref / pi) = -d
    kl = torch.exp(log_ratio) - 1 - log_ratio
    return kl.clamp(min=-LOW_VAR_KL_BOUND, max=LOW_VAR_KL_BOUND)


KL_ESTIMATORS: dict[str, KLEstimator] = {
    "kl": kl_k1,
    "k1": kl_k1,
    "abs": kl_abs,
    "mse": kl_k2,
    "k2": kl_k2,
    "low_var_kl": kl_k3,
    "k3": kl_k3,
}


# Names other frameworks accept that cannot work here, with the reason (the config check before
# launch names it too: roll.launch.named_values).
KL_REFUSED: dict[str, str] = {
    "full": "needs the full vocabulary distributions of policy and reference, which the pipeline "
    "does not keep (only sampled-token log-probs)",
}


def get_kl_estimator(name: str, key: str = "kl_penalty") -> KLEstimator:
    """The estimator called ``name``; ``key`` names the config key in the error message."""
    if name in KL_REFUSED:
        raise ValueError(f"{key}: {name!r} {KL_REFUSED[name]}; use one of {list(KL_ESTIMATORS)}")
    if name not in KL_ESTIMATORS:
        raise ValueError(f"{key}: expected one of {list(KL_ESTIMATORS)}, got {name!r}")
    return KL_ESTIMATORS[name]


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, name: str) -> torch.Tensor:
    """Per-token KL estimate ``[B, R]`` by estimator ``name`` (padding is not zeroed here)."""
    return get_kl_estimator(name)(log_probs, ref_log_probs)
