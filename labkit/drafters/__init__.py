"""Drafters: everything that proposes tokens for the target to verify, behind one interface (base.py), and
nothing else: the heads they draft with are models (labkit.models), their training is labkit.training.

    draft_model    a small model of the same tokenizer (Leviathan 2023); reading, window, vocab, opening: the
                   draft model wrapped to read less (a window, a cut vocabulary, the chat opening copied in)
    prompt_lookup  n-gram copying from the context (no model)
    suffix         suffix decoding: a tree of the likeliest continuations from a suffix trie (no model)
    lookahead      lookahead decoding: Jacobi iterations in the verify forward fill an n-gram pool (no model)
    layer_skip     the target drafting for itself with some layers skipped (layers searched on this machine)
    cross_tokenizer  a draft model with another tokenizer, drafting through text
    medusa         Medusa-1 heads on the target's features, a static top-k tree
    eagle          an EAGLE or EAGLE-3 feature-level head, EAGLE-2 dynamic trees
    mtp, mtp_tree  multi-token heads drafting for their own model (Gloeckle, DeepSeek-V3)
    replay         replayed acceptance: a recorded run's accepted lengths, for timing random-weight models
"""
from .base import Drafter, Needs, Proposal, tree_target
from .cross_tokenizer import CrossTokenizerDrafter, TokenIntersectionDrafter
from .draft_model import DraftModelDrafter, draft_reading
from .eagle import EagleDrafter
from .layer_skip import LayerSkipDrafter
from .lookahead import LookaheadDrafter
from .medusa import MedusaDrafter
from .mtp import DeepSeekDrafter, GloeckleDrafter, MTPDrafter
from .opening import OpeningCopied
from .prompt_lookup import PromptLookupDrafter
from .replay import CostOnly, PacedDrafter, ReplayDrafter, ReplayTreeDrafter
from .suffix import SuffixDrafter
from .vocab import CutVocab
from .window import Windowed

__all__ = ["Drafter", "Needs", "Proposal", "tree_target", "CrossTokenizerDrafter", "TokenIntersectionDrafter",
           "DraftModelDrafter", "draft_reading", "Windowed", "CutVocab", "OpeningCopied", "EagleDrafter",
           "LayerSkipDrafter", "LookaheadDrafter", "MedusaDrafter", "MTPDrafter", "GloeckleDrafter", "DeepSeekDrafter",
           "PromptLookupDrafter", "ReplayDrafter", "ReplayTreeDrafter", "PacedDrafter", "CostOnly", "SuffixDrafter"]
