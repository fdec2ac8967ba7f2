"""Medusa heads: zero init, the drafter's index arithmetic, the greedy tree, training, typical acceptance.

Unit tier on the tiny random models of conftest.py; the last test (integration tier) loads the
shipped heads for the real 1.5B target.
"""
import itertools
import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from labkit.core.sampling import GREEDY
from labkit.core.tree import Tree
from labkit.core.tree_acceptance import greedy_tree_accept
from labkit.core.typical import typical_accept, typical_accept_rule, typical_threshold
from labkit.drafters.medusa import MedusaDrafter, expected_accepted, medusa_tree, path_value, rank_accuracy
from labkit.models.medusa_heads import MedusaHeads, load_medusa, save_medusa
from labkit.training.features import FeatureSet, extract_features, target_features
from labkit.training.train_medusa import (
    IGNORE,
    SubVocab,
    frozen_linear,
    head_labels,
    heldout_loss,
    topk_accuracy,
    train_heads,
)

SHIPPED = Path(__file__).resolve().parent.parent / "data" / "heads" / "medusa-qwen2.5-coder-1.5b"


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors gain nothing from threads, and on a busy machine two threads wait on each other (30x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def greedy_sequence(model, prompt: list[int], n: int) -> torch.Tensor:
    """The model's own greedy continuation, one token at a time (reference, no cache reuse)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]), model.new_cache())[0, -1].argmax()))
    return torch.tensor(seq)


# --- the heads ---------------------------------------------------------------------------------------
def test_zero_initialised_heads_equal_the_lm_head(tiny_target):
    heads = MedusaHeads(tiny_target.lm_head, n_heads=3)
    h = torch.randn(5, tiny_target.args.dim)                                         # (T, D)
    logits = heads(h)                                                                # (K, T, V)
    assert logits.shape == (3, 5, tiny_target.vocab_size)
    for k in range(3):
        torch.testing.assert_close(logits[k], tiny_target.lm_head(h))
    assert set(heads.state_dict()) == {f"blocks.{k}.linear.{p}" for k in range(3) for p in ("weight", "bias")}, \
        "the shared LM head must not be saved with the heads"
    assert heads.lm_head[0] is tiny_target.lm_head, "shared, not copied"


class OracleHeads(MedusaHeads):
    """Features are one-hot positions; head k at position p puts all its mass on seq[p+2+k]."""

    def __init__(self, lm_head, seq: torch.Tensor, n_heads: int):
        super().__init__(lm_head, n_heads)
        self.seq = seq

    def forward(self, hidden):
        p = int(hidden.argmax())
        logits = torch.full((self.n_heads, self.lm_head[0].out_features), -1e4)
        for k in range(self.n_heads):
            logits[k, self.seq[p + 2 + k]] = 0.0
            logits[k, (self.seq[p + 2 + k] + 1) % logits.shape[1]] = -1.0            # a second-best guess
        return logits


def test_drafter_index_arithmetic_follows_the_loop_invariant(tiny_target):
    """Committed x_0..x_{n-1}, features of positions 0..n-2: the rank-0 path is x_n, x_{n+1}, ..."""
    K, seq = 3, torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(0))
    positions = torch.eye(64)                                                         # feature of position p
    drafter = MedusaDrafter(OracleHeads(tiny_target.lm_head, seq, K), [(0,), (0, 0), (0, 0, 0), (1,), (0, 1)])
    n = 10
    drafter.start(seq[:n], positions[: n - 1])                                        # the prompt's cached positions
    _, rank, _ = drafter.tree(10)

    def top_path(prop):                                                               # (0,), (0, 0), (0, 0, 0)
        node, tokens = -1, []
        while len(kids := [c for c in prop.tree.children(node) if rank[c] == 0]):
            node = int(kids[0])
            tokens.append(int(prop.tokens[node]))
        return tokens

    prop = drafter.propose(seq[:n], budget=10, sampling=GREEDY)
    assert top_path(prop) == seq[n:n + K].tolist()
    assert prop.q_draft is None
    # after a step that commits 3 tokens the loop hands over the 3 newly cached positions' features
    drafter.commit(n + 2, positions[n - 1:n + 2])
    prop = drafter.propose(seq[:n + 3], budget=10, sampling=GREEDY)
    assert top_path(prop) == seq[n + 3:n + 3 + K].tolist()
    second = [c for c in prop.tree.children(-1) if rank[c] == 1][0]                  # choice (1,): rank 1 of head 0
    assert int(prop.tokens[second]) == (int(seq[n + 3]) + 1) % 96


def test_training_labels_line_up_with_the_drafter(tiny_target):
    """On the target's own greedy text, head k's label at t is token t+2+k, what the drafter asks of it."""
    seq = greedy_sequence(tiny_target, [5, 17, 3], 20)                                 # (23,)
    _, target_next, _ = target_features(tiny_target, seq[None])                      # (1, T)
    assert target_next[0, 2:-1].tolist() == seq[3:].tolist()                          # greedy: the next token itself
    labels = head_labels(target_next, n_heads=3)                                      # (1, T, K)
    T = seq.numel()
    for k in range(3):
        for t in range(2, T):
            want = int(seq[t + 2 + k]) if t + 2 + k < T else None
            if want is not None:
                assert int(labels[0, t, k]) == want
        assert (labels[0, T - 1 - k:, k] == IGNORE).all()


def test_drafter_budget_and_empty_start(tiny_target):
    heads = MedusaHeads(tiny_target.lm_head, 2)
    choices = medusa_tree(torch.tensor([[0.6, 0.8, 0.9], [0.4, 0.6, 0.7]]), budget=7)
    drafter = MedusaDrafter(heads, choices)
    ids = torch.tensor([1, 2])
    drafter.start(ids[:1], torch.zeros(0, 64))                                        # one-token prompt: no feature
    assert drafter.propose(ids[:1], 5, GREEDY).k == 0
    drafter.commit(1, torch.randn(1, 64))
    for budget in (1, 3, 7, 50):
        prop = drafter.propose(ids, budget, GREEDY)
        assert prop.k == min(budget, 7)
        # zero-init heads all equal the LM head: node rank r at any depth is the LM head's r-th token
        top = tiny_target.lm_head(drafter.last_feature).topk(3).indices
        _, rank, _ = drafter.tree(budget)
        assert prop.tokens.tolist() == top[rank].tolist()


# --- the tree -------------------------------------------------------------------------------------
ACC = torch.tensor([[0.50, 0.65, 0.72, 0.76], [0.30, 0.42, 0.50, 0.55], [0.20, 0.28, 0.33, 0.37]])


def test_medusa_tree_budget_prefixes_and_value_order():
    acc_rank = rank_accuracy(ACC)
    torch.testing.assert_close(acc_rank[0], torch.tensor([0.50, 0.15, 0.07, 0.04], dtype=torch.float64))
    for budget in (1, 5, 20, 40):
        choices = medusa_tree(ACC, budget)
        assert len(choices) == min(budget, 4 + 16 + 64) and len(set(choices)) == len(choices)
        for i in range(1, len(choices) + 1):                                          # every prefix is a tree
            Tree.from_choices(choices[:i])
        values = [path_value(c, acc_rank) for c in choices]
        assert values == sorted(values, reverse=True)
    assert medusa_tree(ACC, 3) == [(0,), (0, 0), (1,)]                                # 0.5, 0.15, 0.15 (ties: lexical)


def test_medusa_tree_is_the_best_tree_of_its_size():
    acc = ACC[:2, :3]                                                                 # 3 + 9 candidate paths
    paths = [(r,) for r in range(3)] + [(a, b) for a in range(3) for b in range(3)]
    for budget in (2, 4, 6):
        best = max(expected_accepted(list(s), acc) for s in itertools.combinations(paths, budget)
                   if all(len(c) == 1 or c[:-1] in s for c in s))
        assert expected_accepted(medusa_tree(acc, budget), acc) == pytest.approx(best)


def test_expected_accepted_matches_a_simulation():
    """Draw each head's right rank independently (or a miss); walk the tree; count accepted nodes."""
    choices = medusa_tree(ACC, 12)
    acc_rank = rank_accuracy(ACC)
    probs = torch.cat([acc_rank, 1 - acc_rank.sum(1, keepdim=True)], 1)               # (K, k+1), last: miss
    g = torch.Generator().manual_seed(0)
    right = torch.multinomial(probs.float(), 20000, replacement=True, generator=g).T   # (n, K)
    in_tree = set(choices)
    total = 0
    for row in right.tolist():
        depth = 0
        while depth < len(row) and tuple(row[:depth + 1]) in in_tree:
            depth += 1
        total += depth
    assert total / right.shape[0] == pytest.approx(expected_accepted(choices, ACC), abs=0.02)


# --- features, training, evaluation ------------------------------------------------------------------
def test_features_train_and_topk_accuracy_end_to_end(tmp_path):
    torch.manual_seed(0)
    target = tiny_model(seed=3)
    seqs = [greedy_sequence(target, [i, 7], 30)[:32] for i in range(6)] + \
           [torch.randint(0, 96, (32,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    out = extract_features(target, seqs, tmp_path / "f", shard_size=4, batch_size=2, meta={"model": "tiny"},
                           progress=False)
    assert sorted(p.name for p in out.glob("shard_*.pt")) == ["shard_000.pt", "shard_001.pt", "shard_002.pt"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokens"] == 9 * 32 and meta["model"] == "tiny"
    shard = torch.load(out / "shard_000.pt")
    assert shard["hidden"].dtype == torch.bfloat16 and shard["hidden"].shape == (4, 32, 64)
    assert shard["target_next"].dtype == torch.long and shard["tokens"].shape == (4, 32)
    mtime = (out / "shard_001.pt").stat().st_mtime_ns
    extract_features(target, seqs, out, shard_size=4, progress=False)                 # resumes: nothing redone
    assert (out / "shard_001.pt").stat().st_mtime_ns == mtime

    data = FeatureSet(out, n_heldout=2)
    tokens, hidden, target_next = data.split("train")
    assert tokens.shape == (7, 32) and data.split("heldout")[0].shape == (2, 32)
    assert torch.equal(tokens, torch.stack(seqs[:7]))

    # the sub-vocabulary: labels map in and back out, and its logits are the full logits' columns
    vocab = SubVocab.of(target_next, 96)
    labels = head_labels(target_next, 3)
    sub = vocab.map(labels)
    valid = labels != IGNORE
    assert torch.equal(vocab.ids[sub[valid]], labels[valid]) and (sub[~valid] == IGNORE).all()
    lm = target.lm_head.weight.float()
    sub_heads = MedusaHeads(frozen_linear(lm[vocab.ids].contiguous()), 3)
    full_heads = MedusaHeads(frozen_linear(lm), 3)
    h = hidden[0, :5].float()
    torch.testing.assert_close(sub_heads(h), full_heads(h)[..., vocab.ids])

    log = train_heads(sub_heads, hidden, sub, steps=80, batch_size=64, lr=3e-3, warmup=5, progress=False)
    losses = log.losses
    assert len(losses) == 80 and log.best_step == 80 and not log.val_losses
    assert sum(losses[-10:]) / 10 < 0.8 * sum(losses[:10]) / 10
    # with held-out data the best weights are kept: its loss at the end is the lowest measured
    val = (hidden[:2], sub[:2])
    log = train_heads(sub_heads, hidden, sub, steps=30, batch_size=64, lr=3e-2, val=val, eval_every=10,
                      progress=False)
    assert log.val_steps == [0, 10, 20, 30]
    assert heldout_loss(sub_heads, val[0].reshape(-1, 64), val[1].reshape(-1, 3)) == pytest.approx(min(log.val_losses))

    full_heads.load_state_dict(sub_heads.state_dict())
    acc = topk_accuracy(full_heads, hidden, target_next, k=5, chunk=37)                # chunk: not a divisor
    # brute force: every (sequence, position, head) by hand
    brute = torch.zeros(3, 5)
    counts = torch.zeros(3)
    with torch.no_grad():
        for s in range(hidden.shape[0]):
            for t in range(32):
                logits = full_heads(hidden[s, t].float())                             # (K, V)
                for k in range(3):
                    if t + 1 + k < 32:
                        rank_ok = logits[k].topk(5).indices == target_next[s, t + 1 + k]
                        brute[k] += rank_ok.cumsum(0).clamp(max=1).float()
                        counts[k] += 1
    torch.testing.assert_close(acc, brute / counts[:, None])
    assert (acc[:, 1:] >= acc[:, :-1]).all()


def test_checkpoint_round_trip(tmp_path, tiny_target):
    heads = MedusaHeads(tiny_target.lm_head, 2)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.1)
    save_medusa(heads, tmp_path, {"base_model": "tiny", "choices": [[0], [0, 0]]}, provenance="# tiny\n")
    from safetensors.torch import load_file
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(stored) == ["blocks.0.linear.bias", "blocks.0.linear.weight", "blocks.1.linear.bias",
                              "blocks.1.linear.weight"]
    loaded, config = load_medusa(tmp_path, tiny_target)
    assert config["n_heads"] == 2 and config["choices"] == [[0], [0, 0]]
    h = torch.randn(3, 64)
    torch.testing.assert_close(loaded(h), heads(h), atol=0.05, rtol=0.02)             # stored in bf16
    with pytest.raises(ValueError, match="hidden size"):
        load_medusa(tmp_path, tiny_model(dim=32, n_heads=2, n_kv_heads=1))


# --- typical acceptance ----------------------------------------------------------------------------------
def random_tree_case(seed: int = 0, V: int = 12):
    tree, _ = Tree.from_choices([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (tree.n_nodes,), generator=g)
    p_target = torch.randn(1 + tree.n_nodes, V, generator=g).mul(2).softmax(-1)       # (1+N, V) full support
    return tree, tokens, p_target


def test_typical_tiny_epsilon_accepts_every_positive_probability_path():
    tree, tokens, p_target = random_tree_case()
    acc = typical_accept(p_target, tree, tokens, epsilon=1e-12, delta=1.0)
    assert acc.n_accepted == int(tree.depth.max())                                   # the deepest path
    assert tree.depth[acc.path].tolist() == [1, 2, 3] and acc.bonus
    assert acc.next_token == int(p_target[1 + acc.path[-1]].argmax())
    # a zero-probability token is never kept, whatever the threshold
    p_zero = p_target.clone()
    p_zero[0, tokens[tree.children(-1)]] = 0
    assert typical_accept(p_zero, tree, tokens, epsilon=1e-12, delta=1.0).n_accepted == 0


def test_typical_unreachable_threshold_accepts_nothing_and_falls_back_to_greedy():
    tree, tokens, p_target = random_tree_case(1)
    acc = typical_accept(p_target, tree, tokens, epsilon=1.0, delta=1e9)             # threshold 1: p > 1 never
    assert acc.n_accepted == 0 and acc.next_token == int(p_target[0].argmax())
    assert acc.tokens(tokens) == [int(p_target[0].argmax())]


def test_typical_with_one_hot_targets_is_greedy_tree_acceptance():
    tree, tokens, _ = random_tree_case(2, V=4)
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        greedy = torch.randint(0, 4, (1 + tree.n_nodes,), generator=g)              # the target's argmax per row
        p_target = torch.nn.functional.one_hot(greedy, 4).float()
        acc = typical_accept(p_target, tree, tokens)
        node, path = -1, []                                                          # greedy walk from the root
        while (nxt := [int(c) for c in tree.children(node) if tokens[c] == greedy[node + 1]]):
            node = nxt[0]
            path.append(node)
        assert acc.path == path and acc.next_token == int(greedy[node + 1])
        assert acc == greedy_tree_accept(tree, tokens, p_target.log())


def test_typical_threshold_follows_entropy_and_ties_go_to_the_likelier_path():
    V = 20
    flat = torch.full((V,), 1 / V)                                                    # H = log 20: threshold 0.3/20
    peaked = torch.full((V,), 0.05 / (V - 1))
    peaked[0] = 0.95                                                                  # low H: threshold 0.09
    assert float(typical_threshold(flat)) == pytest.approx(0.3 / V)
    assert float(typical_threshold(peaked[None])[0]) == pytest.approx(0.09)
    tree = Tree.chain(1)
    assert typical_accept(torch.stack([flat, flat]), tree, torch.tensor([7])).n_accepted == 1
    assert typical_accept(torch.stack([peaked, flat]), tree, torch.tensor([7])).n_accepted == 0
    # two accepted siblings: the likelier one wins
    tree, _ = Tree.from_choices([(0,), (1,)])
    p = torch.zeros(3, V)
    p[0, 3], p[0, 5], p[0, 0] = 0.3, 0.5, 0.2
    p[1:, 0] = 1.0
    acc = typical_accept(p, tree, torch.tensor([3, 5]))
    assert acc.path == [1] and acc.tokens(torch.tensor([3, 5])) == [5, 0]


def test_typical_accept_rule_reads_logits_at_a_temperature():
    tree, tokens, p_target = random_tree_case(3)
    logits = p_target.log() * 2.0                                                     # softmax(logits / 2) = p_target
    assert typical_accept_rule(temperature=2.0)(tree, tokens, logits) == typical_accept(p_target, tree, tokens)
    with pytest.raises(ValueError, match="temperature"):
        typical_accept_rule(temperature=0.0)


# --- the shipped heads (integration tier) ------------------------------------------------------------
@pytest.mark.integration
def test_shipped_medusa_heads_load_and_predict():
    from labkit import autoregressive_generate, load_model
    from labkit.models.hub import DEFAULT_TARGET
    from labkit.models.loading import encode_prompt
    torch.set_num_threads(2)                                                          # restored by one_thread
    size = (SHIPPED / "model.safetensors").stat().st_size
    assert size < 21e6, f"the shipped heads should stay ~19 MB, not {size / 1e6:.0f} MB"
    target = load_model(DEFAULT_TARGET, "fp32")
    heads, config = load_medusa(SHIPPED, target.model)
    acc = torch.tensor(config["topk_accuracy"])                                      # (K, 10)
    assert acc.shape == (config["n_heads"], 10) and (acc[:, 1:] >= acc[:, :-1]).all()
    assert acc[0, 0] > 0.2 and (acc[:-1, 0] >= acc[1:, 0]).all(), "further heads should be less accurate"
    Tree.from_choices([tuple(c) for c in config["choices"]])
    # on the target's own greedy continuation of a prompt, head 0 guesses the token after next often
    ids = encode_prompt(target.tokenizer, "Write a Python function that reverses a linked list.", True)
    seq = torch.cat([ids, torch.tensor(autoregressive_generate(target.model, ids, 32).tokens)])
    with torch.no_grad():
        hidden = target.model.hidden(seq[None], target.model.new_cache(max_len=seq.numel()))[0]   # (T, D)
        guesses = heads(hidden[ids.numel() - 1:-2])[0].argmax(-1)                   # head 0 at t -> token t+2
    hit = (guesses == seq[ids.numel() + 1:]).float().mean()
    assert hit > 0.2
