"""labkit: speculative decoding, readable and measured.

    from labkit import load_model, speculative_generate, DraftModelDrafter
    target, draft = load_model("qwen2.5-coder-1.5b-instruct"), load_model("qwen2.5-coder-0.5b-instruct")
    out = speculative_generate(target.model, DraftModelDrafter(draft.model), prompt_ids, max_new_tokens=64)
"""
from .acceptance import Acceptance, greedy_accept, speculative_accept
from .adaptive import CostAwareGamma, FixedGamma, HeuristicGamma, expected_speedup, expected_tokens
from .autoregressive import autoregressive_generate
from .drafters import DraftModelDrafter, Drafter, PromptLookupDrafter, Proposal
from .kv_cache import KVCache
from .model import ModelArgs, Transformer
from .sampling import GREEDY, SamplingConfig
from .speculative import Generation, SpeculativeDecoder, speculative_generate
from .trace import Step, Trace


def load_model(*args, **kwargs):
    """See labkit.loading.load_model (imported lazily: it pulls in transformers)."""
    from .loading import load_model as _load
    return _load(*args, **kwargs)


__all__ = ["Acceptance", "greedy_accept", "speculative_accept", "CostAwareGamma", "FixedGamma", "HeuristicGamma",
           "expected_speedup", "expected_tokens", "autoregressive_generate", "DraftModelDrafter", "Drafter",
           "PromptLookupDrafter", "Proposal", "KVCache", "ModelArgs", "Transformer", "GREEDY", "SamplingConfig",
           "Generation", "SpeculativeDecoder", "speculative_generate", "Step", "Trace", "load_model"]
