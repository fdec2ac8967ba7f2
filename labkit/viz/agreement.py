"""Two greedy decodes of one prompt, compared: the same tokens, or where they part and why.

Greedy speculative decoding gives the target's greedy output token for token in exact arithmetic
(the tests check it in float32). In bfloat16 a token is scored once in a one-token forward (plain
decoding) and once inside a many-token verify forward, whose sums round differently; when the
target's two best tokens are nearly tied, the two forwards may pick different ones and the
texts part from there. `compare_decodes` finds the first difference and measures the tie in the
target's own forward over the plain answer, so a notebook can say which it was, and fail where it
was not a near-tie (a real bug).

    agreement = compare_decodes(target.model, prompt_ids, plain.tokens, spec.tokens)
    print(agreement.sentence())
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

NEAR_TIE = 0.25     # logits: a top-2 gap below this can flip between a 1-token and a many-token bf16 forward


@dataclass
class Agreement:
    n_same: int              # leading tokens the two decodes share
    n: int                   # tokens compared (the shorter decode)
    gap: float | None        # the target's top-1 minus top-2 logit where they part (None: they do not)

    @property
    def identical(self) -> bool:
        return self.gap is None

    @property
    def near_tie(self) -> bool:
        return self.gap is not None and self.gap < NEAR_TIE

    def sentence(self, what: str = "plain decoding") -> str:
        if self.identical:
            return f"same tokens as {what}: all {self.n}"
        where = f"the same as {what} for {self.n_same} of {self.n} tokens, then they part"
        if self.near_tie:
            return (f"{where}: there the target's two best tokens are {self.gap:.2f} logits apart, a near-tie "
                    "that bfloat16 rounding orders differently in a one-token and a many-token forward "
                    "(in float32 the outputs are equal: the tests check it)")
        return (f"{where}, where the target's choice is clear ({self.gap:.2f} logits ahead): not rounding, "
                "a bug in the decode")


@torch.no_grad()
def compare_decodes(model, prompt_ids: torch.Tensor, reference: list[int], tokens: list[int]) -> Agreement:
    """Compare `tokens` with the greedy `reference` (both after `prompt_ids`); measure the tie where they part."""
    n = min(len(reference), len(tokens))
    i = next((j for j in range(n) if reference[j] != tokens[j]), None)
    if i is None:
        return Agreement(n, n, None)
    context = torch.tensor(prompt_ids.tolist() + reference[:i])                      # (T,)
    logits = model(context[None], model.new_cache(max_len=len(context)), num_logits=1)[0, -1]   # (V,)
    top2 = logits.float().topk(2).values                                            # (2,)
    return Agreement(i, n, float(top2[0] - top2[1]))
