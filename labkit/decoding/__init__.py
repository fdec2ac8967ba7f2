"""Every decode loop, over one request/stop/EOS/seed bookkeeping (base.py); each returns a
`Generation` (the new tokens and the trace of every step), one per row when batched.

    autoregressive  one token per target forward: the baseline
    speculative     propose a chain -> verify -> accept -> commit
    tree            propose a tree -> verify every node at once -> accept a path -> compact
    batched         B sequences at once with any chain drafter, each row accepting its own count (a BatchDecoder:
                    one step a forward for every row, one Generation per row)
    static          a static cache, torch.compile and CUDA graphs: decoding at the speed of memory (GPU)
    compiled        the chain loop on static caches, one compiled shape (and CUDA graph) per draft-length bucket
    compiled_tree   the tree loop on a static cache, one compiled shape (and CUDA graph) per tree-size bucket
    loops           which loop decodes a request: the compiled ones on a GPU, the eager ones elsewhere
"""
from .autoregressive import AutoregressiveDecoder, autoregressive_generate
from .base import Decoder, Generation
from .speculative import SpeculativeDecoder, speculative_generate
from .tree import TreeDecoder, tree_generate

__all__ = ["AutoregressiveDecoder", "autoregressive_generate", "Decoder", "Generation", "SpeculativeDecoder",
           "speculative_generate", "TreeDecoder", "tree_generate"]
