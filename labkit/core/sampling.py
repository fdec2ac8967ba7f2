"""From logits to the distribution we sample from: temperature, top-k, top-p.

Speculative sampling is exact for whatever distribution the target *samples from*, so the
target's `p_target` and the draft's `q_draft` both go through the same warping here
(as transformers does for assisted generation) before the acceptance rule compares them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Below ~1e-36, logits / temperature overflow float32 to inf and the softmax turns NaN; long before that
# the distribution is one-hot in float32 (a logit gap of 0.01 at 1e-4 is a factor e^100): greedy decoding,
# which temperature 0 does exactly. So smaller positive temperatures are refused, never clamped.
MIN_TEMPERATURE = 1e-4
# A top_p float32 rounds to 0 would drop every token (the softmax runs in float32); anything this small keeps only
# the most likely token, which top_k=1 says plainly. So smaller positive values are refused, never clamped.
MIN_TOP_P = 1e-30


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0        # 0 means greedy (argmax)
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {t!r}")
        if 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature {t!r} is too small to divide logits by (they overflow): use 0 for greedy "
                             f"decoding, or a temperature >= {MIN_TEMPERATURE}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)):
            raise ValueError(f"top_k must be an integer >= 1 (or None), got {self.top_k!r}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 (or None for no top-k filter), got {self.top_k}")
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1):
            raise ValueError(f"top_p must be a number in (0, 1] (or None for no top-p filter), got {p!r}")
        if p is not None and p < MIN_TOP_P:
            raise ValueError(f"top_p {p!r} is too small to compare in float32 (it rounds to 0 and drops every token): "
                             f"use top_k=1 to keep only the most likely token, or a top_p >= {MIN_TOP_P}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingConfig()


def probs_from_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The sampling distribution (..., V) for logits (..., V); one-hot at the argmax when greedy."""
    logits = logits.float()
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / cfg.temperature
    if cfg.top_k is not None and cfg.top_k < logits.shape[-1]:
        kth = logits.topk(cfg.top_k, dim=-1).values[..., -1:]                     # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if cfg.top_p is not None and cfg.top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p                              # mass of strictly better tokens
        sorted_p = sorted_p.masked_fill(mass_before >= cfg.top_p, 0.0)           # keeps at least the top token
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def token_probs(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> list[float]:
    """softmax(logits[rows[i]])[tokens[i]] for each i: the target's probability of each proposed token (for the
    trace), normalising only the rows asked for. logits (R, V), rows and tokens (N,). A verify's rows are a
    vocabulary wide (152k for Qwen2.5), so a tree's full softmax would cost every step a pass over all of them."""
    if not rows.numel():
        return []
    used, where = rows.unique(return_inverse=True)                               # (U,), (N,)
    return logits[used].softmax(-1)[where, tokens].tolist()


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of probs (..., V) -> (...)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1), the first index of each row's largest value, (..., V) -> (...). On a CPU through numpy:
    torch's CPU argmax over a 152k vocabulary is many times slower than numpy's, and a decoding loop reads one or
    more such rows every step."""
    if logits.device.type != "cpu" or logits.requires_grad or not logits.dtype.is_floating_point:
        return logits.argmax(-1)
    rows = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    return torch.as_tensor(rows.numpy().argmax(-1))


def next_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick the next token (...) from logits (..., V): argmax when greedy, else a sample."""
    if cfg.greedy:
        return argmax(logits)
    return sample(probs_from_logits(logits, cfg), generator)


def draw(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None):
    """A drafter's pick from logits (..., V): (token (...), the distribution (..., V) it came from).

    Greedy: the argmax, with the plain softmax as the distribution (the trace shows the draft's
    confidence); sampled: a sample from the sampling distribution, which rejection sampling needs.
    """
    if cfg.greedy:
        probs = logits.float().softmax(-1)
        return probs.argmax(-1), probs
    probs = probs_from_logits(logits, cfg)
    return sample(probs, generator), probs
