"""Trees: mask/depth/paths from parents, exact greedy and sampled tree acceptance, KV compaction, exact decoding."""

import pytest
import torch

from labkit import DraftModelDrafter, autoregressive_generate, speculative_generate
from labkit.core.sampling import SamplingConfig
from labkit.core.tree import Tree
from labkit.core.tree_acceptance import greedy_tree_accept, tree_speculative_accept
from labkit.decoding.tree import TreeDecoder, tree_generate
from labkit.drafters.base import Drafter, Proposal


def random_parents(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.tensor([-1] + [int(torch.randint(-1, i, (), generator=g)) for i in range(1, n)])


def brute_ancestors(parents: list[int], i: int) -> list[int]:
    out = [i]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out[::-1]


# --- the tree itself ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_mask_depth_paths_match_a_walk_up_the_parents(seed):
    parents = random_parents(23, seed)
    tree = Tree(parents)
    for i in range(23):
        anc = brute_ancestors(parents.tolist(), i)
        assert tree.mask[i].nonzero()[:, 0].tolist() == sorted(anc)
        assert int(tree.depth[i]) == len(anc)
        assert tree.paths_to(i) == anc
    leaves = [i for i in range(23) if i not in parents.tolist()]
    assert tree.is_leaf.nonzero()[:, 0].tolist() == leaves
    for row, leaf in zip(tree.paths.tolist(), leaves):
        assert [j for j in row if j >= 0] == brute_ancestors(parents.tolist(), leaf)


def test_chain_is_the_degenerate_tree():
    tree = Tree.chain(5)
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3]
    assert torch.equal(tree.mask, torch.ones(5, 5, dtype=torch.bool).tril())
    assert tree.depth.tolist() == [1, 2, 3, 4, 5]
    assert tree.paths.tolist() == [[0, 1, 2, 3, 4]]
    assert tree.positions(10).tolist() == [11, 12, 13, 14, 15]


def test_verify_mask_sees_cache_root_and_ancestors():
    tree = Tree(torch.tensor([-1, -1, 0, 1]))
    m = tree.verify_mask(n_cached=3)                                   # (5, 3+1+4)
    assert m.shape == (5, 8)
    assert m[:, :4].all()                                              # everyone sees the cache and the root
    assert not m[0, 4:].any()                                          # the root sees no node
    assert m[3, 4:].tolist() == [True, False, True, False]             # node 2: itself and node 0
    assert m[4, 4:].tolist() == [False, True, False, True]             # node 3: itself and node 1


def test_medusa_choices_convert_once():
    tree, rank = Tree.from_choices([(1,), (0,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    assert tree.parents.tolist() == [-1, -1, 0, 0, 1, 2]
    assert rank.tolist() == [0, 1, 0, 1, 0, 0]
    assert tree.depth.tolist() == [1, 1, 2, 2, 2, 3]
    with pytest.raises(ValueError, match="prefix"):
        Tree.from_choices([(0,), (1, 0)])


def test_bad_parents_are_refused_with_advice():
    with pytest.raises(ValueError, match="parents come before their children"):
        Tree(torch.tensor([-1, 2, 0]))
    with pytest.raises(ValueError, match="1-D"):
        Tree(torch.zeros(2, 2))


# --- acceptance ----------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(20))
def test_greedy_tree_accept_equals_walking_the_tree(seed):
    g = torch.Generator().manual_seed(seed)
    V, N = 5, 12
    tree = Tree(random_parents(N, seed))
    tokens = torch.randint(0, V, (N,), generator=g)
    logits = torch.randn(1 + N, V, generator=g)
    acc = greedy_tree_accept(tree, tokens, logits)
    node, path = -1, []                                                # walk: follow the child the target picks
    while True:
        want = int(logits[node + 1].argmax())
        kids = [c for c in tree.children(node).tolist() if int(tokens[c]) == want]
        if not kids:
            break
        # several children with the same token: the walk may take any; acceptance takes the deepest line
        node = max(kids, key=lambda c: max(int(tree.depth[j]) for j in range(N) if tree.mask[j, c]
                                          and all(int(tokens[a]) == int(logits[int(tree.parents[a]) + 1].argmax())
                                                  for a in tree.paths_to(j))))
        path.append(node)
    assert len(acc.path) == len(path)
    assert acc.next_token == int(logits[(acc.path[-1] if acc.path else -1) + 1].argmax())
    assert acc.bonus == (bool(acc.path) and bool(tree.is_leaf[acc.path[-1]]))


def _joint_two_tokens(tree, propose, p0, p_next, n_draws, seed):
    """Empirical joint of the first two committed tokens; a step that commits one token continues from p_next[x].

    `propose(g)` drafts afresh each time -> (tokens (N,), q (N, V) or None): sampled candidates are only
    exact over the draft's randomness too, as in SpecInfer's proof.
    """
    g = torch.Generator().manual_seed(seed)
    V = p0.numel()
    counts = torch.zeros(V, V)
    for _ in range(n_draws):
        tokens, q = propose(g)
        p_nodes = torch.stack([p0] + [p_next[int(t)] for t in tokens])   # (1+N, V) rows depend on the token path
        out = tree_speculative_accept(tree, tokens, q, p_nodes, g).tokens(tokens)
        if len(out) == 1:
            out.append(int(torch.multinomial(p_next[out[0]], 1, generator=g)))
        counts[out[0], out[1]] += 1
    return counts


@pytest.mark.parametrize("deterministic", [True, False], ids=["top-k children", "sampled children"])
def test_tree_rejection_sampling_is_distributed_as_the_target(deterministic):
    """chi-square on the joint of the first two tokens: p(x) p(y | x), whatever the tree proposed."""
    from scipy.stats import chisquare
    torch.manual_seed(0)
    V = 4
    p0 = torch.distributions.Dirichlet(torch.ones(V)).sample(torch.Size([])).float()
    p_next = torch.distributions.Dirichlet(torch.ones(V)).sample((V,)).float()   # (V, V) p(y | x)
    q_root = torch.distributions.Dirichlet(torch.ones(V)).sample(torch.Size([])).float()
    q_child = torch.distributions.Dirichlet(torch.ones(V)).sample(torch.Size([])).float()
    # two candidates for the first token, the first with two children of its own
    tree = Tree(torch.tensor([-1, -1, 0, 0]))

    def propose(g):
        if deterministic:                                                # top-2 of q_root, top-2 of q_child
            return torch.cat([q_root.topk(2).indices, q_child.topk(2).indices]), None
        first = torch.multinomial(q_root, 2, replacement=True, generator=g)
        second = torch.multinomial(q_child, 2, replacement=True, generator=g)
        return torch.cat([first, second]), torch.stack([q_root, q_root, q_child, q_child])

    n = 20_000
    counts = _joint_two_tokens(tree, propose, p0, p_next, n, seed=3)
    expected = (p0[:, None] * p_next).flatten() * n
    keep = expected > 5
    stat = chisquare(counts.flatten()[keep], expected[keep] * counts.flatten()[keep].sum() / expected[keep].sum())
    assert stat.pvalue > 1e-3, stat
    assert (counts.sum(1) / n - p0).abs().max() < 0.02


def test_tree_rejection_sampling_with_fixed_sampled_tokens_is_biased():
    """The check above can fail: reuse one draw of sampled candidates for every step and the output is off."""
    torch.manual_seed(0)
    V = 4
    p0 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    p_next = torch.full((V, V), 1 / V)
    q_root = torch.tensor([0.7, 0.1, 0.1, 0.1])
    tree = Tree(torch.tensor([-1]))
    fixed = (torch.tensor([0]), q_root[None])                           # "sampled" once, token 0, reused
    counts = _joint_two_tokens(tree, lambda g: fixed, p0, p_next, 4000, seed=0)
    first = counts.sum(1) / 4000                                        # (V,)
    # accept 0 with p/q = 1/7, else draw from the residual [0, .1, .2, .3] / .6: P(0) = 1/7, P(3) = 3/7
    assert abs(float(first[0]) - 1 / 7) < 0.02 and abs(float(first[3]) - 3 / 7) < 0.03
    assert abs(float(first[0]) - 0.1) > 0.025                          # not the target's 0.1


# --- the cache after a tree step -----------------------------------------------------------------

class RandomTreeDrafter(Drafter):
    """Test drafter: random trees whose first line follows a reference continuation for a while."""
    name = "random-tree"

    def __init__(self, reference: list[int], prompt_len: int, n_nodes: int, seed: int, vocab: int):
        self.reference, self.prompt_len, self.n_nodes, self.vocab = reference, prompt_len, n_nodes, vocab
        self.g = torch.Generator().manual_seed(seed)

    def propose(self, tokens, budget, sampling, generator=None):
        n = min(budget, self.n_nodes)
        parents = random_parents(n, int(torch.randint(0, 10**6, (), generator=self.g)))
        nodes = torch.randint(0, self.vocab, (n,), generator=self.g)
        done = tokens.numel() - self.prompt_len
        node, depth = -1, 0                                            # plant the truth along the first-child line
        while (kids := (parents == node).nonzero()[:, 0]).numel() and done + depth < len(self.reference):
            if torch.rand((), generator=self.g) < 0.2:
                break
            node = int(kids[0])
            nodes[node] = self.reference[done + depth]
            depth += 1
        return Proposal(nodes, tree=Tree(parents))


def test_cache_after_tree_steps_equals_cache_recomputed(tiny_target):
    target = tiny_target
    prompt = torch.tensor([5, 17, 33, 2, 9])
    ref = autoregressive_generate(target, prompt, 30).tokens
    dec = TreeDecoder(target, RandomTreeDrafter(ref, 5, 9, seed=0, vocab=96), prompt, max_new_tokens=30, budget=9)
    for _ in range(4):
        dec.step()
    assert any(s.n_accepted >= 1 for s in dec.trace.steps), "the test should exercise compaction"
    committed = torch.tensor(dec.tokens)
    fresh = target.new_cache()
    target(committed[None, :-1], fresh)
    L = dec.cache.length
    assert L == fresh.length == committed.numel() - 1
    torch.testing.assert_close(dec.cache.k[:, :, :, :L], fresh.k[:, :, :, :L], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(dec.cache.v[:, :, :, :L], fresh.v[:, :, :, :L], atol=1e-5, rtol=1e-4)


# --- exact decoding ------------------------------------------------------------------------------

PROMPTS = [torch.tensor([5, 17, 33, 2, 9]), torch.tensor([1]), torch.tensor([7, 8, 9, 7, 8, 9, 7, 8])]


@pytest.mark.parametrize("n_nodes", [1, 4, 16])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["plain", "one-token", "repetitive"])
def test_greedy_tree_decoding_equals_autoregressive(tiny_target, prompt, n_nodes):
    ref = autoregressive_generate(tiny_target, prompt, max_new_tokens=40)
    drafter = RandomTreeDrafter(ref.tokens, prompt.numel(), n_nodes, seed=n_nodes, vocab=96)
    out = tree_generate(tiny_target, drafter, prompt, max_new_tokens=40, budget=n_nodes)
    assert out.tokens == ref.tokens
    assert out.trace.n_generated == 40
    assert n_nodes == 1 or out.trace.tokens_per_forward > 1.3
    committed = [t for s in out.trace.steps for t in s.accepted_tokens + [s.next_token]]
    assert committed[:40] == ref.tokens


def test_chain_as_tree_matches_the_chain_loop(tiny_target, tiny_draft):
    prompt = PROMPTS[0]
    chain = speculative_generate(tiny_target, DraftModelDrafter(tiny_draft), prompt, 40, gamma=4)
    tree = tree_generate(tiny_target, DraftModelDrafter(tiny_draft), prompt, 40, budget=4)
    assert tree.tokens == chain.tokens
    assert [s.n_accepted for s in tree.trace.steps] == [s.n_accepted for s in chain.trace.steps]


def test_sampled_chain_as_tree_samples_like_the_chain_loop(tiny_target, tiny_draft):
    """Same seed, same drafter, one child per node: tree rejection sampling is chain rejection sampling."""
    cfg = SamplingConfig(temperature=1.0)
    lengths = []
    for seed in range(3):
        out = tree_generate(tiny_target, DraftModelDrafter(tiny_draft), PROMPTS[0], 30, budget=3,
                            sampling=cfg, seed=seed)
        assert out.trace.n_generated == 30
        lengths.append(out.trace.tokens_per_forward)
    assert min(lengths) >= 1.0


def test_budget_and_tree_errors(tiny_target):
    with pytest.raises(ValueError, match="budget"):
        TreeDecoder(tiny_target, DraftModelDrafter(tiny_target), PROMPTS[0], 5, budget=0)


def test_tree_layout_puts_parents_over_their_children():
    from labkit.viz.tree_plots import tree_layout
    tree = Tree(random_parents(15, 3))
    x, y = tree_layout(tree)
    assert torch.equal(y, tree.depth.float())
    leaves_x = x[tree.is_leaf]
    assert leaves_x.unique().numel() == leaves_x.numel()               # leaves never overlap
    for i in range(15):
        kids = tree.children(i)
        if kids.numel():
            assert float(x[i]) == pytest.approx(float(x[kids].mean()))


def test_tree_labels_are_short_and_level():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from labkit.viz.tree_plots import draw_tree, tree_label
    assert tree_label("␣␣␣␣") == "␣×4" and tree_label("↵↵def") == "↵×2d…" and tree_label("␣4") == "␣4"
    assert tree_label("return") == "retu…" and tree_label("ret") == "ret"
    tree = Tree(random_parents(15, 3))
    fig, ax = plt.subplots()
    draw_tree(ax, tree, [tree_label("␣" * (i % 5 + 1) + "x") for i in range(15)], path=[0])
    labels = [t for t in ax.texts if t.get_text() not in ("root",)]
    assert all(t.get_rotation() == 0 for t in labels)                                  # level, never slanted
    assert any("␣ space" in t.get_text() and "␣×4" in t.get_text() for t in labels)   # the glyphs' legend, once
    assert sum("space" in t.get_text() for t in labels) == 1
    plt.close(fig)


def test_greedy_tree_acceptance_reads_few_rows_and_equals_the_every_row_rule():
    """Level by level from the root, it takes the argmax of the root's row and of correct nodes' rows only; on random
    trees with repeated sibling tokens (a 5-token vocabulary) it keeps what the rule over every row keeps."""
    class Rows(torch.Tensor):                 # logits that log which rows are read
        read: list

        def __getitem__(self, index):
            Rows.read.append(index)
            return torch.Tensor.__getitem__(self.as_subclass(torch.Tensor), index)

    g = torch.Generator().manual_seed(3)
    for trial in range(300):
        N = int(torch.randint(1, 30, (), generator=g))
        parents = torch.tensor([int(torch.randint(-1, i, (), generator=g)) for i in range(N)])
        tree, tokens = Tree(parents), torch.randint(0, 5, (N,), generator=g)
        logits = torch.randn(1 + N, 5, generator=g)
        target_next = logits.argmax(-1)                                       # the every-row rule
        correct = ~(tree.mask & ~(tokens == target_next[parents + 1])[None, :]).any(1)
        Rows.read = []
        got = greedy_tree_accept(tree, tokens, logits.as_subclass(Rows))
        if not bool(correct.any()):
            assert got.path == [] and got.next_token == int(target_next[0]), trial
        else:
            best = int(torch.where(correct, tree.depth, 0).argmax())
            assert got.path == tree.paths_to(best) and got.next_token == int(target_next[best + 1]), trial
            assert got.bonus == bool(tree.is_leaf[best]), trial
        rows_read = sum(len(r) if isinstance(r, list) else 1 for r in Rows.read)   # a list of rows, or one row
        assert rows_read == 1 + int(correct.sum()), trial                   # the root's row, then correct nodes'
