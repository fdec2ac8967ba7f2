"""The cost model: bytes moved and FLOPs of one forward, and where it sits on a roofline.

A decode step feeds 1 token, a verify pass the last token plus K draft tokens, a tree verify
N nodes: all are one T-token forward over a cache of P tokens, for each of B sequences.
Per forward the weights stream from memory once whatever T and B are (the point of
speculative decoding: decoding is bound by moving weights), while FLOPs grow with B x T:

    weights   sum of the linears' weights + the lm_head (the embedding table reads B*T rows)
    KV cache  read B*P*L*2*Hkv*hd elements, write B*T*L*2*Hkv*hd
    FLOPs     2 * linear params * B*T  +  4 * L * H * hd * B*T * (P+T)   (QK^T and PV, dense)

A tree's mask hides scores but the dense attention computes them all, so a tree of N nodes
costs what a chain of N tokens costs. Activations (a few B*T*D vectors a layer) are left
out. The roofline: time = max(bytes / bandwidth, FLOPs / peak FLOP/s) (Williams et al. 2009).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.adaptive import expected_tokens
from ..models.transformer import ModelArgs, Transformer
from .device import DeviceProfile


@dataclass(frozen=True)
class Cost:
    """What one forward of `tokens` new tokens per row after `context` cached ones moves and computes."""
    tokens: int
    context: int
    batch: int
    flops: float
    weight_bytes: float
    kv_read_bytes: float
    kv_write_bytes: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved: left of the ridge point it is memory-bound."""
        return self.flops / self.bytes


def linear_params(args: ModelArgs) -> int:
    """Weights every token is multiplied by: attention and MLP linears of every layer and the lm_head."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    per_layer = args.dim * (q + 2 * kv) + q * args.dim + 3 * args.dim * args.hidden_dim
    return args.n_layers * per_layer + args.vocab_size * args.dim


def forward_cost(args: ModelArgs, tokens: int, context: int, batch: int = 1, dtype_bytes: int = 2) -> Cost:
    """One forward of `tokens` per row (1: decode, K+1: verify, N: tree) after `context` cached tokens."""
    if tokens < 1 or context < 0 or batch < 1:
        raise ValueError(f"need tokens >= 1, context >= 0, batch >= 1; got {tokens}, {context}, {batch}")
    n = batch * tokens
    kv_per_token = args.n_layers * 2 * args.n_kv_heads * args.head_dim * dtype_bytes
    attention = 4 * args.n_layers * args.n_heads * args.head_dim * n * (context + tokens)
    weights = linear_params(args) * dtype_bytes + n * args.dim * dtype_bytes          # + the embedding rows read
    return Cost(tokens, context, batch, flops=2 * linear_params(args) * n + attention, weight_bytes=weights,
                kv_read_bytes=batch * context * kv_per_token, kv_write_bytes=n * kv_per_token)


def decode_cost(args: ModelArgs, context: int, batch: int = 1, dtype_bytes: int = 2) -> Cost:
    return forward_cost(args, 1, context, batch, dtype_bytes)


def verify_cost(args: ModelArgs, k: int, context: int, batch: int = 1, dtype_bytes: int = 2) -> Cost:
    """A verify pass of k draft tokens: the last committed token and the k drafts, k+1 in one forward."""
    return forward_cost(args, k + 1, context, batch, dtype_bytes)


def tree_cost(args: ModelArgs, n_nodes: int, context: int, batch: int = 1, dtype_bytes: int = 2) -> Cost:
    """A tree of N nodes: the same dense forward as a chain of N tokens."""
    return forward_cost(args, n_nodes, context, batch, dtype_bytes)


@dataclass(frozen=True)
class Roofline:
    bandwidth: float                 # bytes/s
    peak_flops: float                # FLOP/s
    label: str = ""                  # where the two numbers came from

    @classmethod
    def of(cls, profile: DeviceProfile) -> "Roofline":
        return cls(profile.bandwidth.value, profile.peak_flops.value,
                   f"{profile.name}: {profile.bandwidth.source}; {profile.peak_flops.source}")

    @property
    def ridge(self) -> float:
        """The intensity (FLOP/byte) where memory time equals compute time."""
        return self.peak_flops / self.bandwidth

    def time(self, cost: Cost) -> float:
        """Predicted seconds: the slower of moving the bytes and doing the FLOPs."""
        return max(cost.bytes / self.bandwidth, cost.flops / self.peak_flops)

    def attainable(self, intensity: float) -> float:
        """FLOP/s reachable at this intensity."""
        return min(self.peak_flops, intensity * self.bandwidth)

    def bound(self, cost: Cost) -> str:
        return "memory" if cost.intensity < self.ridge else "compute"

    def crossover_tokens(self, args: ModelArgs, context: int, dtype_bytes: int = 2) -> int:
        """The smallest B*T where a forward turns compute-bound: past it, verifying more tokens costs time."""
        n = 1
        while self.bound(forward_cost(args, n, context, 1, dtype_bytes)) == "memory" and n < 1 << 20:
            n += 1
        return n


def predicted_speedup(roof: Roofline, target: ModelArgs, draft: ModelArgs, batch: int, gamma: int, alpha: float,
                      context: int, dtype_bytes: int = 2) -> float:
    """Leviathan's speedup with roofline costs: E[tokens] target decode steps over (γ draft steps + 1 verify).

    Batched: every row drafts γ and verifies γ+1 tokens in one forward; speculation stops paying when
    the B*(γ+1)-token verify turns compute-bound and costs as much as the tokens it saves.
    """
    t_decode = roof.time(decode_cost(target, context, batch, dtype_bytes))
    t_draft = roof.time(decode_cost(draft, context, batch, dtype_bytes))
    t_verify = roof.time(verify_cost(target, gamma, context, batch, dtype_bytes))
    return expected_tokens(alpha, gamma) * t_decode / (gamma * t_draft + t_verify)


# Shapes from the checkpoints' config.json files, for measurements with random weights where the
# weights cannot be downloaded (a forward's time does not depend on their values).
SHAPES = {
    "qwen2.5-1.5b": ModelArgs(vocab_size=151936, dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, hidden_dim=8960,
                              rope_theta=1_000_000.0, qkv_bias=True, tie_embeddings=True, max_seq_len=32768),
    "qwen2.5-0.5b": ModelArgs(vocab_size=151936, dim=896, n_layers=24, n_heads=14, n_kv_heads=2, hidden_dim=4864,
                              rope_theta=1_000_000.0, qkv_bias=True, tie_embeddings=True, max_seq_len=32768),
    "llama-2-7b": ModelArgs(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, hidden_dim=11008,
                            norm_eps=1e-5, max_seq_len=4096),
}


def random_model(name: str, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16) -> Transformer:
    """A model of SHAPES[name] with PyTorch's default random init, built on `device` (a 7B one in seconds
    on a GPU): what timing runs use where the checkpoint cannot be downloaded."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose from {list(SHAPES)}")
    with torch.device(device):
        return Transformer(SHAPES[name]).to(dtype).eval().requires_grad_(False)
