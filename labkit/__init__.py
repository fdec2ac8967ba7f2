"""labkit: speculative decoding, readable and measured.

    from labkit import load_model, speculative_generate, DraftModelDrafter
    target, draft = load_model("qwen2.5-coder-1.5b-instruct"), load_model("qwen2.5-coder-0.5b-instruct")
    out = speculative_generate(target.model, DraftModelDrafter(draft.model), prompt_ids, max_new_tokens=64)
"""
from .core.acceptance import Acceptance, greedy_accept, speculative_accept
from .core.adaptive import (
    BestRateGamma,
    FixedGamma,
    HeuristicGamma,
    expected_speedup,
    expected_tokens,
)
from .core.sampling import GREEDY, SamplingConfig
from .core.trace import Step, Trace
from .decoding import (
    Generation,
    SpeculativeDecoder,
    TreeDecoder,
    autoregressive_generate,
    speculative_generate,
    tree_generate,
)
from .drafters import (
    Drafter,
    DraftModelDrafter,
    PromptLookupDrafter,
    Proposal,
    SuffixDrafter,
)
from .models.kv_cache import KVCache
from .models.transformer import ModelArgs, Transformer


def load_model(*args, **kwargs):
    """See labkit.models.loading.load_model (imported lazily: it pulls in transformers)."""
    from .models.loading import load_model as _load
    return _load(*args, **kwargs)


__all__ = ["Acceptance", "greedy_accept", "speculative_accept", "BestRateGamma", "FixedGamma", "HeuristicGamma",
           "expected_speedup", "expected_tokens", "autoregressive_generate", "DraftModelDrafter", "Drafter",
           "PromptLookupDrafter", "SuffixDrafter", "Proposal", "KVCache", "ModelArgs", "Transformer", "GREEDY",
           "SamplingConfig", "Generation", "SpeculativeDecoder", "speculative_generate", "TreeDecoder", "tree_generate", "Step", "Trace", "load_model"]
