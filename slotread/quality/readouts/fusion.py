"""Fit a learned readout's temperature and the weights of its partners on held-out items.

A readout's answer to one read (``quality.readouts.readout``) is

    p = softmax(a · s + Σ_j w_j · log d_j),   a = 1/T

s the head's scores W z + b, d_j the partners' distributions for the item (the bank's vote, the
lexical classifier's q̃). θ = (a, w_1, …) minimises the held-out NLL −(1/N) Σ_i log p̄_i(gold_i), p̄_i
the mean of p over item i's reads. The logits are linear in θ, so with one read per item the NLL
is convex in θ (a log-sum-exp of linear functions minus a linear one) and a projected Newton
method finds its minimum in the box a ∈ [1/T_MAX, 1/T_MIN], w_j ∈ [0, WEIGHT_MAX] (a partner is
never subtracted) within a few dozen steps. With several reads per item (a noisy model's draws,
a mean of softmaxes) the NLL need not be convex and the same method finds a local minimum.
Without partners this is temperature scaling.

With few items the minimum runs to the box's corners (eight items per class of six: T = 0.095 and both
weights at the cap, every held-out item right at p ≈ 1, and a test ECE far from the fit's 0.000). So
the fit is shrunk: ``prior_items`` = c adds (c / 2N) · ‖θ − 1‖² to the NLL, a Gaussian prior centred
on T = 1 and equal unit weights (the head's own scores and the plain product of experts) worth about c
items, which fades as N grows. The penalty is convex, so the single-read case stays convex.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from slotread.quality.calibration.methods import T_MAX, T_MIN

#: A partner's weight is searched in [0, WEIGHT_MAX].
WEIGHT_MAX = 5.0
#: Newton steps at most; the search stops earlier when the projected gradient is below TOLERANCE.
MAX_STEPS, TOLERANCE = 100, 1e-9
#: Armijo's sufficient-decrease constant, and the smallest step tried before giving up.
ARMIJO, MIN_STEP = 1e-4, 1e-10


def fusion_nll(theta: torch.Tensor, scores: torch.Tensor, logs: torch.Tensor, gold: torch.Tensor) -> torch.Tensor:
    """The module docstring's NLL at θ (1 + m,): scores (N, R, n), the partners' logs (m, N, n), gold (N,)."""
    logits = theta[0] * scores + torch.einsum("m,mkn->kn", theta[1:], logs)[:, None, :]  # (N, R, n)
    log_p = torch.log_softmax(logits, dim=-1)[torch.arange(len(gold)), :, gold]  # (N, R)
    return -(torch.logsumexp(log_p, dim=1) - np.log(scores.shape[1])).mean()


def fit_fusion(
    scores: np.ndarray, partners: Sequence[np.ndarray], gold: np.ndarray, prior_items: float = 0.0
) -> tuple[float, tuple[float, ...]]:
    """(T, (w_1, …)) minimising the held-out NLL: the head's scores (N, R, n), each partner's positive
    distributions (N, n) over the items, gold option indices (N,); ``prior_items`` > 0 shrinks θ toward 1
    (module docstring)."""
    s = torch.as_tensor(np.asarray(scores, dtype=np.float64))
    logs = torch.as_tensor(np.log(np.stack(partners))) if partners else torch.zeros(0, *s.shape[::2], dtype=s.dtype)
    y = torch.as_tensor(np.asarray(gold, dtype=np.int64))
    low = np.array([1 / T_MAX] + [0.0] * len(partners))
    high = np.array([1 / T_MIN] + [WEIGHT_MAX] * len(partners))

    shrink = prior_items / (2 * max(len(gold), 1))

    def objective(theta: torch.Tensor) -> torch.Tensor:
        return fusion_nll(theta, s, logs, y) + shrink * (theta - 1).pow(2).sum()

    def cost(theta: np.ndarray) -> float:
        return float(objective(torch.as_tensor(theta)))

    theta = np.ones(1 + len(partners))
    for _ in range(MAX_STEPS):
        at = torch.as_tensor(theta).requires_grad_(True)
        with torch.enable_grad():
            value = objective(at)
            (grad,) = torch.autograd.grad(value, at, create_graph=True)
            hessian = np.stack([torch.autograd.grad(g, at, retain_graph=True)[0].numpy() for g in grad])
        g = grad.detach().numpy()
        # variables held at a bound by a gradient pushing outward stay there this step
        free = ~(((theta <= low) & (g > 0)) | ((theta >= high) & (g < 0)))
        if not free.any() or np.abs(g[free]).max() < TOLERANCE:
            break
        direction = np.zeros_like(theta)
        direction[free] = newton_direction(hessian[np.ix_(free, free)], g[free])
        step, f = 1.0, float(value.detach())
        while step >= MIN_STEP:
            trial = np.clip(theta + step * direction, low, high)
            if cost(trial) <= f + ARMIJO * g @ (trial - theta):
                break
            step /= 2
        else:
            break  # no decrease left along the direction: at the minimum to float precision
        theta = trial
    return float(1 / theta[0]), tuple(float(w) for w in theta[1:])


def newton_direction(hessian: np.ndarray, gradient: np.ndarray) -> np.ndarray:
    """−H⁻¹g where H is positive definite (a descent direction), else −g."""
    try:
        np.linalg.cholesky(hessian)
    except np.linalg.LinAlgError:
        return -gradient
    return -np.linalg.solve(hessian, gradient)
