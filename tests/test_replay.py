"""Replayed acceptance: at every root, what a greedy chain drafter would get accepted, equal to decoding's."""
import pytest
import torch
from conftest import tiny_model

from labkit import autoregressive_generate
from labkit.decoding.tree import tree_generate
from labkit.drafters.eagle import EagleDrafter
from labkit.drafters.medusa import MedusaDrafter
from labkit.models.adapters import layer_taps
from labkit.models.eagle_heads import Eagle3Head, EagleConfig
from labkit.models.medusa_heads import MedusaHeads
from labkit.training.eagle_loss import eagle3_loss, vocab_index
from labkit.training.replay import chain_accepts, eagle_guesses, medusa_guesses, summarize

LAYERS = (0, 2, 3)


def test_chain_accepts_counts_leading_hits_and_stops_where_the_text_is_not_the_targets():
    # positions:          0  1  2  3  4  5  6  7
    tokens = torch.tensor([[9, 9, 1, 2, 8, 4, 5, 6]])
    target_next = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]])     # x_1 = 9 and x_4 = 8 are not the target's tokens
    guesses = torch.zeros(1, 7, 3, dtype=torch.long)           # guess k at root t is for target_next[t+1+k]
    guesses[0, 0] = torch.tensor([1, 2, 0])                   # root 0 (x_1 is committed text): two right
    guesses[0, 1] = torch.tensor([2, 3, 4])                   # root 1: step 2 would read x_4 = 8, never drafted: 2
    guesses[0, 2] = torch.tensor([3, 4, 5])                   # root 2: x_4 is not the target's, so not a root
    guesses[0, 3] = torch.tensor([0, 5, 6])                   # root 3: the first is wrong, nothing after it counts
    guesses[0, 5] = torch.tensor([6, 7, 7])                   # root 5: two right, the third step is past the end
    accepted, roots = chain_accepts(guesses, tokens, target_next)
    assert accepted[0].tolist() == [2, 2, 1, 0, 0, 2, 0]
    assert roots[0].tolist() == [True, True, False, True, True, True, False]
    r = summarize(accepted, roots, 3)
    assert r.roots == 5 and r.tokens_per_forward == pytest.approx(1 + 6 / 5)
    assert r.step_acceptance == pytest.approx([3 / 5, 3 / 3, 0 / 3])


@pytest.fixture(scope="module")
def trained():
    """A tiny target, an EAGLE-3 head trained (3 unrolled steps) on its greedy text, and that text."""
    target = tiny_model(seed=0, n_layers=5)
    torch.manual_seed(0)
    prompts = torch.randint(0, target.vocab_size, (12, 4))
    tokens = torch.tensor([p.tolist() + autoregressive_generate(target, p, 24).tokens for p in prompts])  # (12, 28)
    D = target.args.dim
    with torch.no_grad():
        feats = layer_taps(target, tokens, target.new_cache(batch_size=12, max_len=28), LAYERS)  # (12, 28, 4D)
    taps, hidden = feats[..., :3 * D], feats[..., 3 * D:]
    target_next = target.lm_head(hidden).argmax(-1)                                     # (12, 28)
    vocab = target_next.unique()
    head = Eagle3Head(EagleConfig.for_target(target, hidden_dim=96, layers=LAYERS, draft_vocab_size=vocab.numel()),
                      target.vocab_size, target.max_seq_len).float().train()
    head.init_lm_head(target.lm_head.weight[vocab].detach())
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    rows = head.lm_head.weight                                                         # (Vd, D), trained with it
    for _ in range(80):
        r = eagle3_loss(head, target.embed_tokens, rows, vocab_index(vocab, target.vocab_size), tokens, taps,
                        target_next, steps=3)
        opt.zero_grad()
        r.loss.backward()
        opt.step()
    return target, head.eval(), vocab, tokens, taps, hidden, target_next


def decoded_roots(prompt_len: int, steps) -> list[tuple[int, int]]:
    """(root, accepted) of every verify of a chain run. The tree loop's prefill stops before the prompt's last
    token, which the first verify reads with the drafts: the first root is the position before it."""
    out, root = [], prompt_len - 2
    for s in steps:
        out.append((root, s.n_accepted))
        root += 1 + s.n_accepted
    return out


@pytest.mark.parametrize("row", [0, 5])
def test_eagle3_replay_equals_chain_decoding_at_the_roots_it_visits(trained, row):
    target, head, vocab, tokens, taps, hidden, target_next = trained
    depth, prompt = 4, tokens[row, :4]
    out = tree_generate(target, EagleDrafter(head, target, vocab, top_k=1, depth=depth), prompt, 24, budget=depth)
    assert out.tokens == tokens[row, 4:].tolist()                                      # the same greedy text
    guesses = eagle_guesses(head, target.embed_tokens, head.lm_head.weight, vocab,
                            tokens[row:row + 1], taps[row:row + 1].float(), depth)      # (1, T-1, depth)
    accepted, roots = chain_accepts(guesses, tokens[row:row + 1], target_next[row:row + 1])
    visited = decoded_roots(4, out.trace.steps)
    assert sum(a for _, a in visited) > 4                                               # the head drafts well here
    for root, n in visited[:-1]:                                                        # the last may be cut at 24
        assert roots[0, root] and int(accepted[0, root]) == n, (root, n, int(accepted[0, root]))


def test_medusa_replay_equals_chain_decoding(trained):
    """Untrained (identity-initialised) Medusa heads, a 3-deep chain: the replay's accepted count at every
    root decoding visits equals decoding's (hits come from the shared LM head where the text repeats)."""
    target, _, _, tokens, _, hidden, target_next = trained
    torch.manual_seed(1)
    heads = MedusaHeads(target.lm_head, n_heads=3).eval()
    prompt = tokens[2, :4]
    out = tree_generate(target, MedusaDrafter(heads, [(0,), (0, 0), (0, 0, 0)]), prompt, 24, budget=3)
    assert out.tokens == tokens[2, 4:].tolist()
    guesses = medusa_guesses(heads, hidden[2:3])                                       # (1, T-1, 3)
    accepted, roots = chain_accepts(guesses, tokens[2:3], target_next[2:3])
    for root, n in decoded_roots(4, out.trace.steps)[:-1]:
        assert int(accepted[0, root]) == n, (root, n)
