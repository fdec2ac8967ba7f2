"""Arctic Inference's suffix cache (Snowflake's SuffixDecoding engine code) behind labkit's drafter interface.

`make arctic` builds the suffix tree of arctic-inference 0.3.0 (its C++ extension and its `SuffixDecodingCache`)
into build/arctic/pkg (LABKIT_ARCTIC names another folder); the tree decoder verifies the trees it proposes,
as it verifies labkit's suffix drafter's (drafters/suffix.py), with the same settings in Arctic's words: at most
`budget` nodes and spec_factor x match length (`max_spec_factor`), nodes of path probability >= min_prob
(`min_token_prob`), suffixes of up to max_pattern + max_depth tokens indexed (`max_tree_depth`), this request's
prompt and output only (no global cache). labkit.bench.arctic compares the two.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from ..core.sampling import SamplingConfig
from ..core.tree import Tree
from ..files.shipped import CHECKOUT
from .base import Drafter, Needs, Proposal

VERSION = "0.3.0"


def pkg_dir() -> Path:
    return Path(os.environ.get("LABKIT_ARCTIC") or CHECKOUT / "build" / "arctic" / "pkg")


def available() -> bool:
    return (pkg_dir() / "arctic_inference" / "suffix_decoding" / "cache.py").is_file()


def check_available() -> None:
    if not available():
        raise ValueError(f"the Arctic suffix peer needs arctic-inference {VERSION}'s suffix tree in {pkg_dir()}: run "
                         "`make arctic` (about a minute), or set LABKIT_ARCTIC to a folder holding arctic_inference/")


def suffix_cache_class():
    check_available()
    if str(pkg_dir()) not in sys.path:
        sys.path.insert(0, str(pkg_dir()))
    from arctic_inference.suffix_decoding import SuffixDecodingCache
    return SuffixDecodingCache


class ArcticSuffixDrafter(Drafter):
    """Arctic's SuffixDecodingCache drafting trees for labkit's tree decoder (one request at a time)."""
    name = "arctic-suffix"
    needs = Needs(best_first=True)

    def __init__(self, max_pattern: int = 12, max_depth: int = 16, spec_factor: float = 2.0, min_prob: float = 0.1):
        # no global cache of earlier responses: this request's prompt and output only, as labkit's `suffix`
        self.cache = suffix_cache_class()(max_tree_depth=max_pattern + max_depth, max_cached_requests=0)
        self.spec_factor, self.min_prob = spec_factor, min_prob
        self.request, self.seen = None, 0

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        if self.request is not None:
            self.cache.stop_request(self.request)
        self.request = 0 if self.request is None else self.request + 1
        prompt = prompt_ids.flatten().tolist()
        self.cache.start_request(self.request, prompt)
        self.seen = len(prompt)

    def propose(self, tokens: torch.Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> Proposal:
        if self.request is None:
            raise ValueError("call start(prompt_ids) before propose: Arctic's cache indexes the prompt first")
        context = tokens.tolist()
        if len(context) > self.seen:
            self.cache.add_active_response(self.request, context[self.seen:])    # committed since the last step
            self.seen = len(context)
        draft = self.cache.speculate(self.request, context, max_spec_tokens=k, max_spec_factor=self.spec_factor,
                                     min_token_prob=self.min_prob, use_tree_spec=True)
        if not draft.token_ids:
            return Proposal.empty(tokens)
        return Proposal(torch.tensor(draft.token_ids), None, torch.tensor(draft.probs),
                        Tree(torch.tensor(draft.parents)))
