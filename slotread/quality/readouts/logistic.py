"""Multinomial logistic regression on standardised features: the learned readout's head.

    z = (x − μ) / σ                         μ, σ: the training features' mean and standard deviation
    p = softmax((W z + b) / T)              W (n, d), b (n,); T fitted afterwards on held-out items
    loss(W, b) = −(1/N) Σ_i log p_i(gold_i) + (λ/2) ‖W‖²     (T = 1 while fitting; b is not penalised)

Fitted full-batch with L-BFGS in float32 (torch, CPU or GPU): a few thousand items of a 1.5B model's
1,536-dim hidden states train in seconds on two cores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

#: L-BFGS iterations; the loss is convex, so this only bounds the time of an ill-conditioned fit.
MAX_ITERATIONS = 200
#: A feature whose standard deviation is below this is left unscaled (a constant feature).
MIN_SCALE = 1e-6


@dataclass(frozen=True, eq=False)
class LogisticHead:
    """A fitted head: feature mean and scale (d,), weights (n, d) and biases (n,), float64."""

    mean: np.ndarray
    scale: np.ndarray
    weight: np.ndarray
    bias: np.ndarray

    def scores(self, features: np.ndarray) -> np.ndarray:
        """W z + b for features (N, d) -> (N, n): the head's logits before the temperature."""
        standardised = (np.asarray(features, dtype=np.float64) - self.mean) / self.scale
        return standardised @ self.weight.T + self.bias


def standardiser(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The mean and scale of each feature column; a constant column keeps scale 1."""
    mean = features.mean(axis=0)
    scale = features.std(axis=0)
    return mean, np.where(scale < MIN_SCALE, 1.0, scale)


def fit_logistic(features: np.ndarray, gold: np.ndarray, classes: int, l2: float) -> LogisticHead:
    """Minimise the module docstring's loss on features (N, d) and gold class indices (N,) in [0, classes)."""
    mean, scale = standardiser(np.asarray(features, dtype=np.float64))
    x = torch.from_numpy((features - mean) / scale).float()  # (N, d)
    y = torch.from_numpy(np.asarray(gold, dtype=np.int64))
    weight = torch.zeros(classes, x.shape[1], requires_grad=True)
    bias = torch.zeros(classes, requires_grad=True)
    optimiser = torch.optim.LBFGS(
        [weight, bias], max_iter=MAX_ITERATIONS, tolerance_grad=1e-6, history_size=20, line_search_fn="strong_wolfe"
    )

    def closure() -> torch.Tensor:
        optimiser.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ weight.T + bias, y) + 0.5 * l2 * weight.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimiser.step(closure)
    return LogisticHead(mean, scale, weight.detach().double().numpy(), bias.detach().double().numpy())
