"""Decode at the speed of memory: a static KV cache, torch.compile, and one CUDA graph a step.

gpt-fast's recipe, on labkit's model. Eager decoding of a 1.5B model on a GPU is bound by
launching a few hundred small kernels per token, not by HBM. Three things remove that:

1. `StaticKVCache`: each step writes its slot with `index_copy_` at a position *tensor* and
   attends over the whole buffer under a mask, so every decode step has the same shapes and
   no Python number that changes (nothing for torch.compile to specialise on).
2. `torch.compile` fuses norms, RoPE, SiLU and casts into few kernels (fewer HBM round trips).
3. A CUDA graph captures the compiled step once and replays it as a single launch.

Then a step reads every weight once, and `achieved bandwidth = bytes read per step x steps/s`
can be set against the device's peak (scripts/bench_decode.py). Greedy only: this path is
the baseline being measured, not a sampler. Tests tie it to `Transformer.forward` on CPU.
"""
from __future__ import annotations

import time

import torch

from ..core.sampling import GREEDY
from ..core.trace import Step
from ..models.compile_blocks import COMPILE_MODES, compile_blocks
from ..models.cuda_graph import capture_graph
from ..models.kv_cache import StaticKVCache
from ..models.transformer import Transformer
from .base import Decoder, Generation


def compiled(forward, compile: bool | str, backend: str = "inductor", options: dict | None = None):
    """A no-argument step from `forward(run_block)`, as `compile` asks: False, eager; True, the whole forward
    compiled as one graph (the fastest code, the slowest to compile); "blocks", each layer through one compiled
    block (regional compilation: seconds to compile a shape)."""
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")
    if options and not compile:
        raise ValueError("compile_options only apply to compiled steps: pass compile=True or 'blocks' with them")
    if compile == "blocks":
        run_block = compile_blocks(backend, options)
        return lambda: forward(run_block)
    step = lambda: forward(None)                                                         # noqa: E731
    # dynamic=False: each shape is its own static graph (dynamo would otherwise generalise the second one)
    return torch.compile(step, backend=backend, fullgraph=True, dynamic=False, options=options) if compile else step


def static_forward(model: Transformer, cache: StaticKVCache, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                   mask: torch.Tensor | None = None, run_block=None, hidden: bool = False, taps: tuple[int, ...] = ()):
    """Logits (B, T, V) of `tokens` (B, T) written at slots `cache.slots`; fixed shapes, no Python state.

    positions (T,): RoPE positions, default the slots; mask (T, max_len): the slots each token sees, default
    those at or before its own (a tree passes depths and its ancestor mask). run_block: how to run each layer
    (compile_blocks). hidden: return (features, logits), the features being the final hidden states (B, T, D),
    or with `taps` the outputs of those blocks and then the final hidden states (B, T, (len(taps) + 1) D), as
    EAGLE-3 reads them (models/adapters.layer_taps).
    """
    B, T = tokens.shape
    if positions is None:
        positions = cache.slots
    if mask is None:
        mask = torch.arange(cache.max_len, device=tokens.device) <= cache.slots[:, None]  # (T, max_len)
    tapped = []

    def tapping(block, x, cos, sin, cache, layer, mask):                                 # each block, its output kept
        y = block(x, cos, sin, cache, layer, mask) if run_block is None else run_block(block, x, cos, sin, cache,
                                                                                       layer, mask)
        if layer in taps:
            tapped.append(y)                                                             # (B, T, D)
        return y
    h = model.blocks(tokens, cache, positions.expand(B, T), mask, tapping if taps else run_block)  # (B, T, D)
    logits = model.lm_head(h).float()                                                    # (B, T, V)
    if not hidden:
        return logits
    return (torch.cat(tapped + [h], dim=-1) if taps else h), logits


def prefill(model: Transformer, cache: StaticKVCache, tokens: torch.Tensor, **kwargs):
    """Write `tokens` (T,) at slots 0 .. T-1 (eagerly: one shape per prompt) and make them the cache's length;
    `static_forward`'s output for them (kwargs pass through), None for no tokens."""
    T = tokens.numel()
    cache.slots = torch.arange(T, device=model.device)
    out = static_forward(model, cache, tokens[None].to(model.device), **kwargs) if T else None
    cache.length = T
    return out


class StaticDecoder(Decoder):
    """Greedy decoding through `static_forward`: eager, compiled, and/or replayed as a CUDA graph.

        dec = StaticDecoder(model, max_len=1024, compile=True, cuda_graph=True)
        gen = dec.generate(prompt_ids, max_new_tokens=256)     # gen.tokens, gen.trace.decode_tokens_per_second
        dec.start(prompt_ids, 64); dec.step()                   # or one step at a time, as any Decoder

    compile: torch.compile the one-token step (`compile_backend`, default inductor; "eager" only
    traces it, which is what the CPU tests check), whole (True) or a block at a time ("blocks", see `compiled`); `compile_options` go to inductor, e.g. gpt-fast's
    {"coordinate_descent_tuning": True}, which tunes each generated kernel's block sizes by timing
    them (slower to compile). cuda_graph: capture the step once (CUDA only).

    Each step feeds itself on the device: its argmax is the next step's input token, and the slot advances there
    too, so `read_every` steps run back to back, queued by the host without waiting, and the host reads their
    tokens at once (one host sync a chunk, as gpt-fast's loop, which never waits). Default: 8 with a CUDA graph,
    where waiting for every token would idle the GPU while the host launches the next graph; 1 otherwise (a step
    past an end-of-sequence token is wasted work, and a CPU gains nothing from queueing).
    """

    def __init__(self, model: Transformer, max_len: int, compile: bool | str = False, cuda_graph: bool = False,
                 compile_backend: str = "inductor", compile_options: dict | None = None, read_every: int | None = None):
        if cuda_graph and model.device.type != "cuda":
            raise ValueError("cuda_graph=True needs the model on a CUDA device; use cuda_graph=False on "
                             f"{model.device.type}")
        if max_len > model.max_seq_len:
            raise ValueError(f"max_len={max_len} exceeds the model's context of {model.max_seq_len}")
        self.read_every = (8 if cuda_graph else 1) if read_every is None else read_every
        if isinstance(self.read_every, bool) or not isinstance(self.read_every, int) or self.read_every < 1:
            raise ValueError(f"read_every={read_every}: pass the number of tokens to decode between two reads of "
                             "the host, >= 1 (1: read every token)")
        self.model, self.max_len, self.cuda_graph = model, max_len, cuda_graph
        p = model.embed_tokens.weight
        a = model.args
        self.cache = StaticKVCache(a.n_layers, 1, a.n_kv_heads, max_len, a.head_dim, p.dtype, p.device)
        self.step_slot = self.cache.slots   # (1,) the decode step's slot: the tensor a captured graph reads
        self.step_token = torch.zeros(1, 1, dtype=torch.long, device=p.device)  # (1, 1) its input token
        self.fed = torch.zeros(max_len, dtype=torch.long, device=p.device)      # the chunk's tokens, in order
        self.fed_index = torch.zeros(1, dtype=torch.long, device=p.device)     # (1,) where the next one goes
        self._step = compiled(lambda run_block: static_forward(self.model, self.cache, self.step_token,
                                                               run_block=run_block),
                              compile, compile_backend, compile_options)
        self._graph, self._graph_logits, self._warm = None, None, False

    def _fed_step(self) -> torch.Tensor:
        """The step, then on the device: its greedy token is the next step's input and joins `fed`, and the slot
        advances. Logits (1, 1, V)."""
        logits = self._step()                                                    # (1, 1, V)
        token = logits[0, -1].argmax(-1, keepdim=True)                           # (1,)
        self.fed.index_copy_(0, self.fed_index, token)
        self.step_token.copy_(token.view(1, 1))
        self.step_slot.add_(1)
        self.fed_index.add_(1)
        return logits

    @torch.no_grad()
    def prefill(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        """Run the prompt (T,) through the model (eagerly: one shape per prompt); logits (V,) of its last token."""
        logits = prefill(self.model, self.cache, prompt_ids)                              # (1, T, V)
        self.cache.slots = self.step_slot
        return logits[0, -1]

    def _run_step(self) -> torch.Tensor:
        """One fed step: the graph's replay (recorded on first use), or the step itself; logits (1, 1, V)."""
        if not self.cuda_graph:
            return self._fed_step()
        if self._graph is None:
            self.warmup()
        self._graph.replay()
        return self._graph_logits

    @torch.no_grad()
    def warmup(self) -> None:
        """Compile the step and capture its graph now, not inside a timed run (writes a few slots from slot 0:
        harmless before a prefill, which overwrites them)."""
        self._warm = True
        self.fed_index.zero_()
        if not self.cuda_graph:
            self._fed_step()
            return
        # the warm-up runs write a few slots from the current one, with the tokens they feed themselves: harmless
        self._graph, self._graph_logits = capture_graph(self._fed_step, warmups=3)  # logits (1, 1, V), refilled

    @torch.no_grad()
    def start(self, prompt_ids: torch.Tensor, max_new_tokens: int, eos_token_ids: tuple[int, ...] = ()
              ) -> "StaticDecoder":
        """A new request (greedy): check it, read the prompt, and commit the first token, the prefill's; then
        `step()` decodes one token at a time, `run()` to the end."""
        self.begin(self.model, prompt_ids, max_new_tokens, "static", eos_token_ids, None, GREEDY)
        if self.prompt.numel() + max_new_tokens > self.max_len:
            raise ValueError(f"{self.prompt.numel()} prompt + {max_new_tokens} new tokens exceed "
                             f"max_len={self.max_len}")
        if not self._warm:
            self.warmup()
        self._sync()
        self._t0 = time.perf_counter()
        token = int(self.prefill(self.prompt).argmax())
        self._sync()
        self.trace.prefill_time = self.trace.total_time = time.perf_counter() - self._t0
        self._record(Step([], 0, token, True, 0.0, 0.0), self._commit([token]))
        return self

    @torch.no_grad()
    def _advance(self) -> Step:
        """Up to `read_every` decode steps queued back to back, each fed by the last on the device, then their tokens
        read at once (one host sync); a Step is recorded for each token (its time: the chunk's share), up to EOS."""
        t1 = time.perf_counter()
        n = min(self.read_every, self.max_new_tokens - self.trace.n_generated)
        if self.cache.length + n > self.max_len:
            raise ValueError(f"the static cache is full ({self.max_len} slots); build it with a larger max_len")
        self.step_slot.fill_(self.cache.length)                  # the last committed token, at the next slot
        self.step_token.fill_(self.tokens[-1])
        self.fed_index.zero_()
        for _ in range(n):
            self._run_step()
        tokens = self.fed[:n].tolist()                           # the chunk's one host sync
        seconds = (time.perf_counter() - t1) / n
        step = self._commit_each(tokens, lambda i, token: Step([], 0, token, True, 0.0, seconds))
        self.trace.total_time += time.perf_counter() - t1
        return step

    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int,
                 eos_token_ids: tuple[int, ...] = ()) -> Generation:
        """Greedy: the prompt (T,), then up to `max_new_tokens` tokens, one decode step each (the first comes
        from the prefill), stopping after an end-of-sequence token. The trace has a step per token; its total
        time runs from the prefill to the last token, after a device synchronisation."""
        gen = self.start(prompt_ids, max_new_tokens, eos_token_ids).run()
        self._sync()
        gen.trace.total_time = time.perf_counter() - self._t0
        return gen

    def _sync(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()
