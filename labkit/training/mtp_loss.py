"""The multi-token loss, two ways: naive (all n logits alive) and head by head (Gloeckle et al. 2024, sec. 2).

Naive: forward every head, sum the n cross-entropies, one backward; the n (B, T, V) logits and
their gradients are alive together, O(nV + d) per position. Head by head: forward the trunk once,
detach its output z, then for each head forward + backward into z.grad (its logits freed before
the next head), and finally backward the trunk once with the summed z.grad: O(V + d).
Both give the same gradients (tests/test_mtp.py). DeepSeek modules chain through each other,
so they train the naive way here.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..models.mtp import MTPModel, PassThroughCache, cross_entropy, mtp_window_targets


class MTPLoss(NamedTuple):
    total: float                   # sum_j weight_j * loss_j
    per_head: list[float]          # nats, offset j predicting token i+j+1


def naive_backward(model: MTPModel, window: torch.Tensor, T: int) -> MTPLoss:
    """All heads' logits at once, one backward. window: (B, T + n)."""
    logits = model.training_logits(window, T)                                  # n x (B, T, V)
    losses = [cross_entropy(lg, mtp_window_targets(window, T, j)) for j, lg in enumerate(logits)]
    total = sum(w * loss for w, loss in zip(model.loss_weights(), losses))
    total.backward()
    return MTPLoss(float(total.detach()), [float(x.detach()) for x in losses])


def headwise_backward(model: MTPModel, window: torch.Tensor, T: int) -> MTPLoss:
    """Gloeckle's memory-efficient order: trunk forward, each head forward+backward, trunk backward."""
    if model.cfg.kind == "deepseek":
        raise ValueError("DeepSeek modules feed each other (module k needs module k-1's hidden state): "
                         "use naive_backward for them")
    cache = PassThroughCache()
    rope = model.rope(0, T, window.shape[0])
    z = model.trunk_hidden(window[:, :T], cache, rope)                         # (B, T, D)
    z_detached = z.detach().requires_grad_()                                   # heads' gradients gather here
    losses, total = [], 0.0
    for j, weight in enumerate(model.loss_weights()):
        logits = model.logits(model.head_hidden(j, z_detached, cache, rope), j)  # (B, T, V), freed after backward
        loss = cross_entropy(logits, mtp_window_targets(window, T, j))
        (weight * loss).backward()                                             # head j's grads, and into z.grad
        losses.append(float(loss.detach()))
        total += weight * float(loss.detach())
        del logits, loss
    z.backward(z_detached.grad)                                                # the trunk, once
    return MTPLoss(total, losses)


@torch.no_grad()
def evaluate(model: MTPModel, windows: torch.Tensor, T: int, batch_size: int = 16) -> list[float]:
    """Mean loss (nats) of every offset over fixed validation windows (N, T + n)."""
    sums = None
    for b in range(0, windows.shape[0], batch_size):
        chunk = windows[b:b + batch_size]
        logits = model.training_logits(chunk, T)
        losses = [cross_entropy(lg, mtp_window_targets(chunk, T, j)) * chunk.shape[0] for j, lg in enumerate(logits)]
        sums = losses if sums is None else [s + x for s, x in zip(sums, losses)]
    return [float(s) / windows.shape[0] for s in sums]
