"""Tree speculation at the speed of memory: the tree loop on a static cache, one compiled shape per tree size.

The eager tree loop (tree.py) is the reference; this is the same propose -> verify -> accept -> commit on the
static cache of compiled.py, for drafters that propose trees (Medusa's static tree, suffix decoding's):

1. Verify: the root (the last committed token) and the N tree nodes in one forward, padded to a bucket of
   `TREE_BUCKETS` = (0, 8, 16, 32, 64) nodes, so the verify has five shapes (0: a plain step, the root alone, as
   plain decoding's step, where a cost-aware budget declines to draft), each compiled once and on CUDA
   recorded once as a CUDA graph. A tree's shape (parents) is laid out on the device the first time it is seen
   (`TreeLayout`: depths, ancestors, paths), so a step sends only its token ids, in one copy that does not wait;
   the RoPE positions and the ancestor block are buffers filled on the device, and the mask over the cache is
   made from the block inside the graph (`compiled.tree_mask`). A padding node sees the cache and itself, and no
   real node sees it.
2. Accept on the device (`greedy_tree_accept_on_device`): a node is good when its token is the target's
   greedy pick after its parent; the deepest node whose whole path is good wins (the first of the deepest,
   as `core.tree_acceptance.greedy_tree_accept`). Sampling (`sampled_tree_accept_on_device`) is the same walk
   with one draw from the target's distribution in place of each row's pick: for a tree of top-k picks that is
   multi-candidate rejection sampling exactly (`core.tree_acceptance.tree_speculative_accept`). One host sync
   reads the accepted depth, the path and the target's next token.
3. Commit: `KVCache.commit_path` copies the keys and values of the root and the accepted path to the slots
   right after the committed ones (Medusa's compaction), on the device; every other branch is dropped.

Batch size 1, labkit's own `Transformer` as the target; drafters that read the final hidden states (Medusa,
EAGLE) or three blocks' outputs besides (EAGLE-3) get them from the verify as in the eager loop. Greedy output
equals `autoregressive_generate`'s token for token, and sampled output has the target's distribution
(tests/test_compiled_tree.py); scripts/gpu_check.py times it on a GPU.
"""
from __future__ import annotations

import time
from typing import NamedTuple

import torch

from ..core.sampling import GREEDY, SamplingConfig, probs_from_logits
from ..core.trace import Step
from ..core.tree import Tree
from ..core.tree_budget import BudgetPolicy, FixedBudget
from ..drafters.base import Drafter, Proposal, tree_target
from ..models.adapters import LayerTapsTarget
from ..models.kv_cache import StaticKVCache
from ..models.target import as_tree_target
from ..models.transformer import Transformer
from .base import Decoder, Generation, check_drafter
from .compiled import (
    PLAIN_RUN,
    Clock,
    FixedShapeStep,
    check_static_loop,
    fed_steps,
    sample_without_sync,
)
from .host_sync import read_back
from .static import prefill

TREE_BUCKETS = (0, 8, 16, 32, 64)  # tree sizes the verify forward is compiled for; N nodes pad up to the next one
MAX_NODES = TREE_BUCKETS[-1]


def tree_bucket(n: int) -> int:
    """The verify width (in nodes) for a tree of n nodes: the smallest bucket that holds it."""
    return next(b for b in TREE_BUCKETS if b >= n)


class TreeLayout(NamedTuple):
    """A tree's shape laid out at a bucket's width B, on the device: what every tree of that shape shares, so it is
    made once per shape (`CompiledTreeDecoder.layout`) and only the tokens travel each step."""
    positions: torch.Tensor     # (1+B,) RoPE offsets from the root: root 0, node depth (padding: 0)
    block: torch.Tensor         # (1+B, 1+B) bool, which of the step's slots each row sees
    parent_rows: torch.Tensor   # (B,) the row of each node's parent (0: the root)
    ancestors: torch.Tensor     # (B, B) bool, node j is node i or one of its ancestors
    depth: torch.Tensor         # (B,) 1 for the root's children, 0 for padding
    path_rows: torch.Tensor     # (B, D) rows of each node's path, root's child first, padded with its own row
    earlier_siblings: torch.Tensor  # (B, B) bool, node j is a child of node i's parent listed before node i


def lay_out(tree: Tree, width: int, device: torch.device | str = "cpu") -> TreeLayout:
    """A tree of N <= width nodes padded to `width`: a padding node sees the cache and itself, no real node sees it."""
    N, B = tree.n_nodes, width
    ancestors = torch.eye(B, dtype=torch.bool)                                   # (B, B) padding: itself
    ancestors[:N, :N] = tree.mask
    block = torch.eye(1 + B, dtype=torch.bool)                                   # (1+B, 1+B)
    block[1:N + 1, 0] = True                                                     # every node sees the root
    block[1:, 1:] = ancestors
    depth = torch.zeros(B, dtype=torch.long)
    depth[:N] = tree.depth
    D = max(1, int(depth.max())) if N else 1
    path_rows = torch.arange(1, B + 1)[:, None].repeat(1, D)                     # (B, D)
    node, ancestor = tree.mask.nonzero(as_tuple=True)                            # parents come first: by depth
    path_rows[node, depth[ancestor] - 1] = 1 + ancestor
    parent_rows = torch.zeros(B, dtype=torch.long)
    parent_rows[:N] = tree.parents + 1
    positions = torch.cat([torch.zeros(1, dtype=torch.long), depth])
    earlier_siblings = (parent_rows[:, None] == parent_rows[None, :]).tril(-1)         # (B, B)
    return TreeLayout(*(x.to(device) for x in (positions, block, parent_rows, ancestors, depth, path_rows,
                                               earlier_siblings)))


def lay_out_on_device(parents: torch.Tensor, width: int, max_depth: int) -> TreeLayout:
    """`lay_out` for a tree whose parents (N,) are on the device (a drafter that drafts there), without reading them
    back: fixed shapes, path_rows `max_depth` wide (the tree is no deeper)."""
    N, B, dev = parents.numel(), width, parents.device
    padded = torch.cat([parents, parents.new_full((B - N,), -1)])                # (B,) padding: under the root
    real = torch.arange(B, device=dev) < N                                       # (B,)
    ancestors = torch.eye(B, dtype=torch.bool, device=dev)                       # (B, B)
    up, columns = padded, torch.arange(B, device=dev)
    for _ in range(max_depth - 1):                 # a node at depth d has d - 1 ancestors: one level a pass
        ancestors = ancestors | (up[:, None] == columns)                         # (one_hot would check on the host)
        up = torch.where(up >= 0, padded[up.clamp(min=0)], -1)
    depth = torch.where(real, ancestors.sum(-1), 0)                              # (B,)
    block = torch.eye(1 + B, dtype=torch.bool, device=dev)                       # (1+B, 1+B)
    block[1:, 0] = real
    block[1:, 1:] = ancestors
    rows = torch.arange(1, B + 1, device=dev)                                    # (B,) each node's row
    at_level = ancestors[:, :, None] & (depth[None, :, None] == torch.arange(1, max_depth + 1, device=dev))
    path_rows = torch.where(at_level.any(1), (at_level * rows[None, :, None]).sum(1), rows[:, None])  # (B, Dm)
    parent_rows = torch.where(real, padded + 1, 0)                               # (B,)
    positions = torch.cat([depth.new_zeros(1), depth])
    earlier_siblings = (parent_rows[:, None] == parent_rows[None, :]).tril(-1)   # (B, B)
    return TreeLayout(positions, block, parent_rows, ancestors, depth, path_rows, earlier_siblings)


class TreeAcceptanceOnDevice(NamedTuple):
    n_accepted: torch.Tensor    # () depth of the accepted path, 0..D
    keep_rows: torch.Tensor     # (1+D,) the root's row, then the path's rows (padded past n_accepted)
    next_token: torch.Tensor    # () the target's pick after the last accepted node


def greedy_tree_accept_on_device(t: TreeLayout, nodes: torch.Tensor,
                                 target_logits: torch.Tensor) -> TreeAcceptanceOnDevice:
    """`core.tree_acceptance.greedy_tree_accept` without leaving the device. nodes (B,) padded with -1,
    target_logits (1+B, V)."""
    target = target_logits.argmax(-1)                                            # (1+B,) the target's picks
    return deepest_good_path(t, nodes == target[t.parent_rows], target)


def sampled_tree_accept_on_device(t: TreeLayout, nodes: torch.Tensor, p_target: torch.Tensor,
                                  generator: torch.Generator | None = None) -> TreeAcceptanceOnDevice:
    """`core.tree_acceptance.tree_speculative_accept` for a tree of top-k picks (q one-hot) without leaving the
    device. nodes (B,) padded with -1, p_target (1+B, V), unnormalised is fine.

    Trying a node's children in order, child c (token x) is accepted with probability p(x) and otherwise x leaves
    the residual, so child c wins with probability p(x) and, when none wins, the next token y is drawn from p
    without the children's tokens: what one draw y ~ p after the node gives, with y = x choosing child c. So each
    row draws one token of the target's, and a node is good when its token is its parent's draw (and no earlier
    sibling has that token: a repeated token's residual mass is 0). The rows are drawn independently, as the
    rejection sampler's uniforms are, so the committed tokens are the target's own samples."""
    drawn = sample_without_sync(p_target, generator)[:, 0]                       # (1+B,) one draw a row
    good = nodes == drawn[t.parent_rows]                                         # (B,)
    repeated = (t.earlier_siblings & (nodes[:, None] == nodes[None, :])).any(-1)  # (B,)
    return deepest_good_path(t, good & ~repeated, drawn)


def deepest_good_path(t: TreeLayout, good: torch.Tensor, picks: torch.Tensor) -> TreeAcceptanceOnDevice:
    """The first of the deepest nodes whose whole path is good (B,), and the pick (1+B,) after it. Every index is a
    one-element tensor, never a 0-d one: indexing with a 0-d tensor reads it back to the host (on a GPU, a sync).
    A plain step (B = 0) keeps the root and the pick after it."""
    if good.numel() == 0:
        return TreeAcceptanceOnDevice(picks.new_zeros(()), picks.new_zeros(1), picks[0])
    whole_path_good = ~(t.ancestors & ~good).any(-1)                             # (B,)
    score = torch.where(whole_path_good, t.depth, 0)                             # (B,)
    best = score.argmax().view(1)                                                # (1,) the first of the deepest
    n = score.index_select(0, best)                                              # (1,)
    last_row = torch.where(n > 0, best + 1, 0)                                   # (1,) the root when none agreed
    keep_rows = torch.cat([last_row.new_zeros(1), t.path_rows.index_select(0, best)[0]])   # (1+D,)
    return TreeAcceptanceOnDevice(n[0], keep_rows, picks.index_select(0, last_row)[0])


def feature_taps(model: Transformer, drafter: Drafter) -> tuple[int, ...]:
    """The blocks whose outputs `drafter` reads besides the final hidden states: () for Medusa and EAGLE, EAGLE-3's
    three; a ValueError for a drafter that needs another kind of target."""
    plain = as_tree_target(model)
    wanted = tree_target(drafter, plain)
    if wanted is plain:
        return ()
    if isinstance(wanted, LayerTapsTarget) and wanted.model is model:
        return tuple(wanted.layers)
    raise ValueError(f"the {drafter.name} drafter reads a target of its own ({type(wanted).__name__}): decode it "
                     "with labkit.decoding.tree.tree_generate")


class CompiledTreeDecoder(Decoder):
    """Tree speculative decoding on a static cache: eager, compiled, and/or replayed as CUDA graphs; greedy or
    sampled (trees of top-k picks).

        dec = CompiledTreeDecoder(target, MedusaDrafter(heads, choices), max_len=1024, compile="blocks",
                                  cuda_graph=True)
        gen = dec.generate(prompt_ids, max_new_tokens=256, budget=32)

    budget: nodes a step, 1..64 (or a budget policy, core.tree_budget.BudgetPolicy). compile, cuda_graph, compile_backend,
    compile_options: as `CompiledSpeculativeDecoder`'s. max_len must hold prompt + max_new_tokens + 64 (the
    verify writes its padded tree past the last token).
    """

    def __init__(self, model: Transformer, drafter: Drafter, max_len: int, compile: bool | str = False,
                 cuda_graph: bool = False, compile_backend: str = "inductor", compile_options: dict | None = None):
        check_static_loop(model, cuda_graph, max_len, MAX_NODES + 2, "labkit.decoding.tree.tree_generate")
        self.how = dict(compile=compile, cuda_graph=cuda_graph, compile_backend=compile_backend,
                        compile_options=compile_options)
        a, p = model.args, model.embed_tokens.weight
        self.model, self.max_len, self.taps = model, max_len, None
        self.cache = StaticKVCache(a.n_layers, 1, a.n_kv_heads, max_len, a.head_dim, p.dtype, p.device)
        self.layouts: dict[tuple, TreeLayout] = {}      # (width, parents): the tree shapes seen, on the device
        # the step's root and node ids travel in one copy: from page-locked memory on a GPU, without waiting
        self.ids_host = torch.zeros(1 + MAX_NODES, dtype=torch.long, pin_memory=p.device.type == "cuda")
        self.ids_np = self.ids_host.numpy()           # the same memory: filled without a torch op each write
        self.ids = torch.zeros(1 + MAX_NODES, dtype=torch.long, device=p.device)   # (1+64,)
        self.blocks_in: dict[int, TreeLayout] = {}    # bucket: the layout whose block its verify buffer holds
        self.use_drafter(drafter)

    def use_drafter(self, drafter: Drafter) -> None:
        """Draft with `drafter` from the next `start` on, keeping the compiled shapes and graphs (a drafter that
        reads other blocks' outputs gets verify shapes of its own)."""
        check_drafter(drafter)
        if drafter.needs.verdict:
            raise ValueError(f"the {drafter.name} drafter reads the target's verdict on every node: decode it with "
                             "labkit.decoding.tree.tree_generate")
        taps = feature_taps(self.model, drafter)
        drafter.check_target(self.model)
        if taps != self.taps:
            self.verify_steps = {b: FixedShapeStep(self.model, self.cache, 1 + b, tree=True, taps=taps, **self.how)
                                 for b in TREE_BUCKETS}
            self.blocks_in = {}
        self.drafter, self.taps = drafter, taps

    @torch.no_grad()
    def warmup(self, budgets=None) -> None:
        """Compile (and record) the verify shapes of these budgets (default: every bucket) now, before `start`."""
        for b in TREE_BUCKETS if budgets is None else sorted({tree_bucket(min(n, MAX_NODES)) for n in budgets}):
            self.verify_steps[b]()

    @torch.no_grad()
    def start(self, prompt_ids: torch.Tensor, max_new_tokens: int, budget: int | BudgetPolicy = 32,
              sampling: SamplingConfig = GREEDY, eos_token_ids: tuple[int, ...] = (),
              seed: int | None = None) -> "CompiledTreeDecoder":
        """Begin a sequence: check the request, prefill the cache with the prompt but its last token."""
        self.begin(self.model, prompt_ids, max_new_tokens, f"compiled-tree/{self.drafter.name}", eos_token_ids, seed,
                   sampling)
        self.budget = budget if callable(getattr(budget, "budget", None)) else FixedBudget(budget)
        if isinstance(budget, int) and not 0 <= budget <= MAX_NODES:
            raise ValueError(f"budget={budget}: the compiled verify has shapes for up to {MAX_NODES} nodes; pass "
                             f"0 <= budget <= {MAX_NODES}")
        if not sampling.greedy and self.drafter.needs.samples_tokens:
            raise ValueError(f"the {self.drafter.name} drafter samples its tokens: when sampling, the compiled tree "
                             "loop accepts trees of top-k picks; sample with labkit.decoding.tree.tree_generate")
        if getattr(self.budget, "needs_best_first", False) and not self.drafter.needs.best_first:
            raise ValueError(f"the {self.budget.name} budget needs a drafter that lists its nodes best first; "
                             f"{self.drafter.name} does not: give it a fixed budget (an int)")
        need = self.prompt.numel() + max_new_tokens + MAX_NODES
        if need > self.max_len or self.prompt.numel() + max_new_tokens > self.model.max_seq_len:
            raise ValueError(f"{self.prompt.numel()} prompt + {max_new_tokens} new tokens + {MAX_NODES} padding "
                             f"slots exceed max_len={self.max_len} (or the model's context of "
                             f"{self.model.max_seq_len}): build the decoder with max_len >= {need}")
        device = self.model.device
        self.device_generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        t0 = time.perf_counter()
        features = torch.zeros(0, (len(self.taps) + 1) * self.model.args.dim,
                               dtype=self.model.embed_tokens.weight.dtype, device=device)   # (0, F)
        out = prefill(self.model, self.cache, self.prompt[:-1], hidden=True, taps=self.taps)  # all but the last
        if out is not None:
            features = out[0][0]                                                     # (T-1, F)
        sync()
        t1 = time.perf_counter()
        self.drafter.start(self.prompt, features if self.drafter.needs.features else None)
        sync()
        self.trace.prefill_time = self.trace.total_time = time.perf_counter() - t0
        self.trace.draft_prefill_time = time.perf_counter() - t1
        return self

    @torch.no_grad()
    def _advance(self) -> Step:
        """propose a tree -> verify it -> accept a path -> commit and compact, once; one host sync. Where the budget
        says 0, a run of the plain steps it is sure of instead (`plain_run`)."""
        n_cached, trace = self.cache.length, self.trace
        asked, left = self.budget.budget(), self.max_new_tokens - trace.n_generated
        budget = min(asked, MAX_NODES, left - 1)
        if budget <= 0:
            return self.plain_run(min(self.budget.plain_steps(), PLAIN_RUN, left) if asked == 0 else 1)
        t0, clock = time.perf_counter(), Clock(self.model.device)
        # 1. Propose: a tree of candidate continuations (on the host, or the drafter's own device work)
        tree, node_tokens, q_token, layout, parents = self.propose(budget)                # (N,) each
        N = node_tokens.numel()
        clock.mark()
        # 2. Verify: root + every node at the bucket's width, each node seeing the cache and its ancestors
        nodes = self.send(node_tokens, layout.depth.numel())                             # (B,) padded with -1
        hidden, logits = self.verify(layout, nodes, n_cached)                            # (1+B, D), (1+B, V)
        clock.mark()
        # 3. Accept, on the device: the deepest path the target agrees with, and its pick (or draw) after it
        if self.sampling.greedy:
            acc = greedy_tree_accept_on_device(layout, nodes, logits)
        else:
            p_target = probs_from_logits(logits, self.sampling)                          # (1+B, V)
            acc = sampled_tree_accept_on_device(layout, nodes, p_target, self.device_generator)
        # 4. Commit, queued before the sync: the root's and the deepest path's keys and values to the slots right
        #    after the committed ones (all D + 1 rows: those past the accepted ones land where no token looks)
        self.cache.commit_path(acc.keep_rows, start=n_cached)
        parts = dict(n_accepted=acc.n_accepted.view(1), next_token=acc.next_token.view(1), keep_rows=acc.keep_rows,
                     nodes=nodes)                                                    # (1,), (1,), (1+D,), (B,)
        if parents is not None:
            parts["parents"] = parents                   # a device tree's shape (N,)
        read_q = q_token.device == nodes.device          # a drafter's on the device (Medusa's): read with the rest
        if read_q:
            parts["q_token"] = q_token                   # (N,)
        got = read_back(**parts)                                                         # the step's one host sync
        n, next_token, keep, node_list = got.n_accepted[0], got.next_token[0], got.keep_rows, got.nodes[:N]
        if tree is None:
            tree = Tree(torch.tensor(got.parents))
        q_list = got.q_token if read_q else q_token.tolist()
        draft_time, verify_time = clock.seconds()
        self.cache.length = n_cached + n + 1
        if self.drafter.needs.features:
            self.drafter.commit(n_cached + n + 1, hidden[acc.keep_rows[:n + 1]])
        else:
            self.drafter.commit(n_cached + n + 1)
        path = [r - 1 for r in keep[1:n + 1]]
        new_tokens = self._commit([node_list[i] for i in path] + [next_token])
        step = Step(node_list, n, next_token, bool(n) and tree.is_leaf[path[-1]].item(), draft_time,
                    verify_time, q_draft=q_list, parents=tree.parents.tolist(), path=path, asked=budget)
        self.budget.update(step)
        return self._record(step, new_tokens, t0)

    def propose(self, budget: int):
        """(tree, node tokens (N,), q_token (N,), layout, parents (N,)): the drafter's tree of at most `budget` nodes
        and its layout at its bucket's width. A drafter that drafts on the device keeps its tree there: tree None,
        its parents on the device, read back with the step's sync; any other's tree is on the host (parents None).

        The device-drafting protocol: a drafter whose needs say device="tree" (drafters/eagle_device.py) has
        propose_on_device(tokens, budget), which returns a DeviceTree (tokens, q_token and parents, on the device,
        nothing read back) and has a `depth`, the deepest level it grows."""
        if self.drafter.needs.device == "tree":
            drafted = self.drafter.propose_on_device(torch.tensor(self.tokens), budget)
            if drafted.tokens.numel():
                layout = lay_out_on_device(drafted.parents, tree_bucket(drafted.tokens.numel()), self.drafter.depth)
                return None, drafted.tokens, drafted.q_token, layout, drafted.parents
            proposal = Proposal.empty(self.prompt)
        else:
            proposal = self.drafter.propose(torch.tensor(self.tokens), budget, self.sampling, self.generator)
        proposal = proposal.limit(budget)
        if proposal.q_draft is not None and not self.sampling.greedy:
            raise ValueError(f"the {self.drafter.name} drafter samples its tree's tokens (q_draft): the compiled loop "
                             "accepts trees of top-k picks; sample with labkit.decoding.tree.tree_generate")
        tree = proposal.as_tree()
        return tree, proposal.tokens, proposal.q_token, self.layout(tree), None

    @torch.no_grad()
    def plain_run(self, r: int) -> Step:
        """r plain steps on the device: each verifies the root alone (the last committed token), as plain decoding
        does, and feeds its pick (or draw) to the next; one host sync reads all r. A step is recorded, and the budget
        told, for each token; the drafter gets the run's features afterwards. Returns the last step."""
        t0, clock, step = time.perf_counter(), Clock(self.model.device), self.verify_steps[0]
        first = self.cache.length                         # the root's slot: every committed token before it is cached
        if self.blocks_in.get(0) is None:                 # a one-token block: the root sees itself
            step.block.fill_(True)
            self.blocks_in[0] = self.layout(Tree.chain(0))
        picks, features = fed_steps(step, first, self.tokens[-1], r, self.sampling, self.device_generator, clock)
        tokens, seconds = picks.tolist(), clock.seconds()                            # the run's one host sync
        last = self._commit_each(tokens, lambda i, token: Step([], 0, token, False, 0.0, seconds[i], q_draft=[],
                                                               parents=[], path=[], asked=0), self.budget.update)
        if self.drafter.needs.features:
            self.drafter.commit(self.cache.length, torch.cat(features)[:self.cache.length - first])
        else:
            self.drafter.commit(self.cache.length)
        self.trace.total_time += time.perf_counter() - t0
        return last

    def layout(self, tree: Tree) -> TreeLayout:
        """The tree's shape laid out at its bucket's width on the device, made the first time the shape is seen (a
        static tree, or a replay, has a few shapes; a dynamic tree's are kept up to 1024)."""
        width = tree_bucket(tree.n_nodes)
        key = (width, *tree.parents.tolist())
        if key not in self.layouts:
            if len(self.layouts) >= 1024:
                self.layouts.clear()
            self.layouts[key] = lay_out(tree, width, self.model.device)
        return self.layouts[key]

    def send(self, node_tokens: torch.Tensor, width: int) -> torch.Tensor:
        """The root (the last committed token) and the node tokens (N,) on the device in one copy that does not
        wait for the device, the nodes (width,) padded with -1; node tokens a drafter left on the device (Medusa's
        heads' picks) are copied there, never read back before the step's sync. The verify's token buffer gets
        them, padding as 0."""
        N, on_host = node_tokens.numel(), node_tokens.device.type == "cpu"
        host = self.ids_np[:1 + width]          # free again: the last step's copy finished before its host sync
        host[0] = self.tokens[-1]
        if on_host:
            host[1:1 + N] = node_tokens.numpy()
        host[1 + N:] = -1
        ids = self.ids[:1 + width]
        ids.copy_(self.ids_host[:1 + width], non_blocking=True)
        if not on_host:
            ids[1:1 + N].copy_(node_tokens)
        torch.clamp(ids, min=0, out=self.verify_steps[width].tokens[0])
        return ids[1:]

    def verify(self, layout: TreeLayout, nodes: torch.Tensor, n_cached: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states (1+B, D) and logits (1+B, V) of the root and the padded tree (its tokens already in the
        width's buffer, `send`), written at the slots n_cached .. n_cached + B."""
        step = self.verify_steps[nodes.numel()]
        if self.blocks_in.get(nodes.numel()) is not layout:     # a static tree's block is copied once
            step.block.copy_(layout.block)
            self.blocks_in[nodes.numel()] = layout
        torch.add(layout.positions, n_cached, out=step.positions)
        step.at(n_cached)
        self.cache.length = n_cached + 1 + nodes.numel()
        hidden, logits = step()
        return hidden[0], logits[0]

    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int,
                 budget: int | BudgetPolicy = 32, sampling: SamplingConfig = GREEDY,
                 eos_token_ids: tuple[int, ...] = (), seed: int | None = None) -> Generation:
        """Decode up to max_new_tokens after prompt_ids (T,): `start`, then step to the end."""
        gen = self.start(prompt_ids, max_new_tokens, budget, sampling, eos_token_ids, seed).run()
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()
        return gen
