"""Inputs crafted from a module's own weights so that a masked key would take a row's weight with every value
finite: an allowed key's score overflows to -inf, or falls below the mask's bias, while a masked key's stays small.
Random inputs never find this; a hostile client can build it from the served weights."""

from __future__ import annotations

import numpy as np
import torch

from tests.support import rand


def inputs_projecting_to(layer: torch.nn.Linear, targets: np.ndarray) -> np.ndarray:
    """Rows x with layer(x) == each target row (solved in float64 from the module's own weights)."""
    weight = layer.weight.detach().double().numpy()
    bias = layer.bias.detach().double().numpy()
    return np.linalg.solve(weight, (targets - bias).T).T.astype(np.float32)


def crafted_cross_attention(module):
    """One query row and two keys, key 1 masked (key padding [1, 0]): the allowed key's score overflows to -inf,
    the masked key's is 0."""
    d = module.d_model
    query = inputs_projecting_to(module.W_q, np.full((1, d), 1e19))[None]
    key = inputs_projecting_to(module.W_k, np.stack([np.full(d, -1e20), np.zeros(d)]))[None]
    mask = np.array([[[[True, False]]]])
    return query, key, mask


def crafted_first_step(module):
    """A sequence's first two rows: row 0 in a direction whose query and key disagree in every head, scaled so
    that its most negative own score is -2.5e38, below the mask's bias (-1.7e38), and every raw score finite in
    whatever order its terms are summed; row 1 is zeros, so row 0's score on it (the future, masked) is small."""
    w_q, w_k = (layer.weight.detach().double().numpy() for layer in (module.W_q, module.W_k))
    for seed in range(10000):
        direction = rand(module.d_model, seed=seed).astype(np.float64)
        terms = ((w_q @ direction) * (w_k @ direction)).reshape(module.num_heads, module.d_k)
        per_head = terms.sum(axis=1) / np.sqrt(module.d_k)
        if not (per_head < 0).all():
            continue
        scale = 2.5e38 / -per_head.min()
        if max(terms.clip(min=0).sum(axis=1).max(), -terms.clip(max=0).sum(axis=1).max()) * scale < 3e38:
            break
    x = np.zeros((1, 2, module.d_model), np.float32)
    x[0, 0] = direction * np.sqrt(scale)
    return x
