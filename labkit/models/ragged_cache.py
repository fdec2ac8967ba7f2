"""A KV cache shared by B sequences that hold different numbers of tokens.

One KVCache holds all B rows and its write pointer moves for all of them together; what
differs per row is which slots count. `RaggedCache` records, for every row and slot, the
token position the slot holds (-1: padding or rolled back). A query at position p sees the
row's slots holding positions <= p, and each row's RoPE positions are its own, so left
padding (prompts of different lengths) and rows keeping different counts after a rollback
are both the same thing: slots a row ignores. Rollback is per row (`truncate_rows`); the
shared cache then drops the slots no row keeps. The model's explicit `positions` and `mask`
arguments carry all of it: no change to the model.
"""
from __future__ import annotations

import torch


class RaggedCache:
    """A KVCache shared by B rows that hold different numbers of tokens."""

    def __init__(self, model, batch_size: int, max_len: int):
        self.model = model
        self.cache = model.new_cache(batch_size, max_len)
        self.slot_pos = torch.full((batch_size, max_len), -1, dtype=torch.long)       # (B, S) position, -1 none
        self.length = torch.zeros(batch_size, dtype=torch.long)                        # (B,) tokens held per row

    def feed(self, tokens: torch.Tensor, n_real: torch.Tensor) -> torch.Tensor:
        """Append row b's last n_real[b] tokens of `tokens` (B, T) (the rest is padding); logits (B, T, V)."""
        B, T = tokens.shape
        L = self.cache.length
        real = torch.arange(T)[None, :] >= (T - n_real)[:, None]                        # (B, T)
        positions = self.length[:, None] + real.long().cumsum(1) - 1                   # (B, T); pads: length-1
        positions = positions.clamp(min=0)
        self.slot_pos[:, L:L + T] = torch.where(real, positions, -1)
        held = self.slot_pos[:, :L + T]                                                # (B, S)
        mask = (held[:, None, :] >= 0) & (held[:, None, :] <= positions[:, :, None])   # (B, T, S)
        mask[:, torch.arange(T), L + torch.arange(T)] = True                           # a pad sees itself: no empty row
        device = self.model.device
        logits = self.model(tokens.to(device), self.cache, positions=positions.to(device),
                            mask=mask[:, None].to(device))                             # (B, T, V)
        self.length += n_real
        return logits.cpu()

    def truncate_rows(self, lengths: torch.Tensor) -> None:
        """Keep each row's first lengths[b] tokens; drop the slots no row holds any more."""
        if bool((lengths > self.length).any()) or bool((lengths < 0).any()):
            raise ValueError(f"cannot truncate rows holding {self.length.tolist()} tokens to {lengths.tolist()}")
        self.slot_pos[self.slot_pos >= lengths[:, None]] = -1
        self.length = lengths.clone()
        used = torch.nonzero((self.slot_pos[:, :self.cache.length] >= 0).any(0))
        self.cache.truncate(int(used[-1]) + 1 if used.numel() else 0)

    def room(self) -> int:
        """Slots left in the shared buffer."""
        return self.cache.room()


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-aligned token rows (B, T) padded with 0 on the left, and each row's real count (B,)."""
    T = max(len(r) for r in rows)
    return torch.tensor([[0] * (T - len(r)) + r for r in rows]).long(), torch.tensor([len(r) for r in rows])


def unpad(values: torch.Tensor, n_real: torch.Tensor) -> torch.Tensor:
    """Left-align right-aligned rows: values (B, T, ...) whose row b is real in its last n_real[b] columns
    -> (B, T, ...) with those columns first (the tail repeats the last column)."""
    B, T = values.shape[:2]
    idx = (torch.arange(T)[None, :] + (T - n_real)[:, None]).clamp(max=T - 1)         # (B, T)
    return values[torch.arange(B)[:, None], idx]
