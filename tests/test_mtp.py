"""Multi-token prediction: the head-by-head loss equals the naive one, self-speculative greedy decoding equals
the model's own greedy decoding, and the shipped checkpoints reproduce their recorded validation loss."""
import json
from pathlib import Path

import pytest
import torch
from conftest import require_shipped, tiny_mtp

from labkit import SamplingConfig, autoregressive_generate, speculative_generate
from labkit.drafters.mtp import self_speculative
from labkit.models.mtp import MTPConfig, MTPModel
from labkit.training.mtp_data import fixed_windows
from labkit.training.mtp_loss import evaluate, headwise_backward, naive_backward
from labkit.training.train_mtp import WINDOW_EXTRA, load_checkpoint, train

DATA = Path(__file__).resolve().parents[1] / "data" / "mtp"
# What is shipped is what data/mtp/configs/ trains (`make train-mtp` writes one checkpoint per config, same name)
CONFIGS = {path.stem: json.loads(path.read_text()) for path in sorted((DATA / "configs").glob("*.json"))}
SHIPPED = sorted(CONFIGS)                                                         # every checkpoint
SHIPPED_MTP = [name for name in SHIPPED if CONFIGS[name]["model"]["kind"] != "next"]   # those with heads to draft with
PROMPTS = [torch.tensor([5, 17, 33, 2, 9]), torch.tensor([1]), torch.tensor([7, 8, 9, 7, 8, 9, 7, 8])]
pytestmark = pytest.mark.usefixtures("one_thread")


def grads(model):
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("n", [1, 2, 4])
def test_headwise_loss_equals_naive(n):
    model = tiny_mtp("gloeckle" if n > 1 else "next", n, scale=1.0)
    window = torch.randint(0, 256, (3, 40 + n), generator=torch.Generator().manual_seed(n))
    naive = naive_backward(model, window, 40)
    g_naive = grads(model)
    model.zero_grad(set_to_none=True)
    headwise = headwise_backward(model, window, 40)
    g_headwise = grads(model)
    assert headwise.per_head == pytest.approx(naive.per_head, rel=1e-6)
    assert headwise.total == pytest.approx(naive.total, rel=1e-6)
    assert g_headwise.keys() == g_naive.keys() and len(g_naive) == len(list(model.parameters()))
    for name in g_naive:
        torch.testing.assert_close(g_headwise[name], g_naive[name], rtol=1e-4, atol=1e-6, msg=name)


def test_headwise_refuses_deepseek_modules():
    with pytest.raises(ValueError, match="naive_backward"):
        headwise_backward(tiny_mtp("deepseek", 3), torch.zeros(1, 20, dtype=torch.long), 16)


def test_config_errors_say_what_to_do():
    with pytest.raises(ValueError, match="kind must be one of"):
        MTPConfig(kind="medusa")
    with pytest.raises(ValueError, match="n_future >= 2"):
        MTPConfig(kind="gloeckle", n_future=1)
    with pytest.raises(ValueError, match="no extra heads"):
        self_speculative(MTPModel(MTPConfig(dim=32, n_heads=2, hidden_dim=32, n_trunk=1)))
    config = json.loads((DATA / "configs" / "next.json").read_text())
    config["train"]["precision"] = "fp8"
    with pytest.raises(ValueError, match="train.precision must be one of"):
        train(config, DATA / "never-written")


@pytest.mark.parametrize("kind,n", [("gloeckle", 2), ("gloeckle", 4), ("gloeckle", 8), ("deepseek", 2), ("deepseek", 4)])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["plain", "one-token", "repetitive"])
def test_random_model_greedy_self_speculative_equals_autoregressive(kind, n, prompt):
    model = tiny_mtp(kind, n).eval().requires_grad_(False)
    ref = autoregressive_generate(model, prompt, max_new_tokens=50)
    for gamma in sorted({1, n - 1}):
        out = speculative_generate(*self_speculative(model), prompt, max_new_tokens=50, gamma=gamma)
        assert out.tokens == ref.tokens


def test_deepseek_incremental_drafts_match_full_window():
    """Each step's draft, made through the modules' own caches, equals the modules run on the whole sequence."""
    model = tiny_mtp("deepseek", 4, scale=3.0).eval().requires_grad_(False)
    out = speculative_generate(*self_speculative(model), PROMPTS[0], max_new_tokens=40, gamma=3)
    committed = PROMPTS[0].tolist()
    for step in out.trace.steps:
        p = len(committed) - 2
        pad = [0] * (3 - step.gamma)                                                 # modules past K see padding only
        window = torch.tensor(committed + step.proposed + pad)[None]                 # (1, N + 3)
        logits = model.training_logits(window, p + 1)                                # per offset, (1, p+1, V)
        full = [int(logits[1 + k][0, p].argmax()) for k in range(step.gamma)]
        assert step.proposed == full
        committed += step.proposed[:step.n_accepted] + [step.next_token]


def top_k_of_head1(model, prompt: torch.Tensor, new_tokens: list[int], k: int) -> list[list[int]]:
    """Head 1's top-k after each prefix that produced a new token: what top-k sampling may emit there."""
    seq = torch.cat([prompt, torch.tensor(new_tokens)])
    logits = model(seq[None, :-1], model.new_cache())[0]                           # (T-1, V) head 1's
    return logits[prompt.numel() - 1:].topk(k, dim=-1).indices.tolist()            # (len(new_tokens), k)


@pytest.mark.parametrize("kind", ["gloeckle", "deepseek"])
def test_sampled_self_speculative_emits_only_what_head1_can_sample(kind):
    """Top-20 sampling: heads 2..n draft from their own top 20, which mostly misses head 1's; such a draft has
    p = 0 and must be rejected, so every committed token is in head 1's top 20 where it was emitted. Drafts do get
    accepted (the check covers them, not only head 1's own samples), and the seed fixes the output."""
    model = tiny_mtp(kind, 4, scale=1.0).eval().requires_grad_(False)
    cfg = SamplingConfig(temperature=0.8, top_k=20)
    out = speculative_generate(*self_speculative(model), PROMPTS[0], 40, gamma=3, sampling=cfg, seed=0)
    assert len(out.tokens) == 40 and sum(s.n_accepted for s in out.trace.steps) >= 1
    allowed = top_k_of_head1(model, PROMPTS[0], out.tokens, 20)
    assert [t for t, top in zip(out.tokens, allowed) if t not in top] == []
    again = speculative_generate(*self_speculative(model), PROMPTS[0], 40, gamma=3, sampling=cfg, seed=0)
    assert again.tokens == out.tokens


@pytest.mark.parametrize("kind", ["gloeckle", "deepseek"])
def test_sampling_with_top_k_1_is_greedy_decoding(kind):
    """Through the sampling path (warped q and p, rejection sampling): a one-token support gives greedy output."""
    model = tiny_mtp(kind, 4).eval().requires_grad_(False)
    out = speculative_generate(*self_speculative(model), PROMPTS[0], 40, gamma=3,
                               sampling=SamplingConfig(temperature=0.8, top_k=1), seed=0)
    assert out.tokens == autoregressive_generate(model, PROMPTS[0], max_new_tokens=40).tokens


def shipped(name):
    require_shipped(DATA / f"{name}.safetensors", "run `make train-mtp`")
    return load_checkpoint(DATA / name)


def test_every_config_has_its_checkpoint_and_a_results_row():
    """configs/ -> checkpoints (make train-mtp) -> results.json rows (scripts/mtp_results.py): none left behind."""
    for name in SHIPPED:
        require_shipped(DATA / f"{name}.safetensors", "run `make train-mtp`")
    checkpoints = sorted(path.stem for path in DATA.glob("*.safetensors"))
    assert SHIPPED_MTP and len(SHIPPED_MTP) < len(SHIPPED), "both multi-token and next-token-only models are shipped"
    assert checkpoints == SHIPPED, "run `make train-mtp` (or remove the config of a model no longer shipped)"
    assert sorted(json.loads((DATA / "results.json").read_text())["models"]) == SHIPPED, \
        "run `python scripts/mtp_results.py`"
    for name in SHIPPED:                                            # each checkpoint was trained from its config
        meta = json.loads((DATA / f"{name}.json").read_text())
        assert meta["model"] == {**meta["model"], **CONFIGS[name]["model"]}
        assert meta["train"] == {**meta["train"], **CONFIGS[name]["train"]}


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_checkpoint_reproduces_its_validation_loss(name):
    model, meta = shipped(name)
    T = meta["train"]["seq_len"]
    heldout = torch.frombuffer(bytearray((DATA / "heldout.txt").read_bytes()), dtype=torch.uint8)
    windows = fixed_windows(heldout, meta["val_slice_windows"], T + WINDOW_EXTRA)
    assert evaluate(model, windows, T) == pytest.approx(meta["val_slice_loss_nats"], rel=2e-3)


@pytest.mark.parametrize("name", SHIPPED_MTP)
def test_shipped_checkpoint_greedy_self_speculative_equals_autoregressive(name):
    model, meta = shipped(name)
    prompts = json.loads((DATA / "results.json").read_text())["prompts"][:2]
    for text in prompts:
        prompt = torch.tensor(list(text.encode("latin-1")))
        ref = autoregressive_generate(model, prompt, max_new_tokens=96)
        out = speculative_generate(*self_speculative(model), prompt, max_new_tokens=96, gamma=model.cfg.n_future - 1)
        assert out.tokens == ref.tokens
        assert out.trace.tokens_per_forward > 1.3, "a trained model's heads should get drafts accepted"


def like_for_like(rows: dict, row: dict, same: str) -> list[str]:
    """The next-token-only rows with `row`'s trunk and precision trained on equal data (same steps) or with equal
    compute (training FLOPs within 2%): results.md's definition, re-derived here from the rows."""
    def matches(other):
        if other["kind"] != "next" or other["trunk"] != row["trunk"] or other["precision"] != row["precision"]:
            return False
        if same == "data":
            return other["steps"] == row["steps"]
        return abs(other["train_flops"] / row["train_flops"] - 1) < 0.02
    return [name for name, other in rows.items() if matches(other)]


def test_committed_loss_comparisons_are_like_for_like():
    """results.md compares each model with next-token-only models of the same trunk: at equal data (same steps and
    precision) and at equal compute (training FLOPs within 2%). The recorded baselines are exactly those the
    checkpoints' own records give (never ambiguous), every multi-token model has at least one, and the recorded
    gaps are the losses' ratios."""
    rows = json.loads((DATA / "results.json").read_text())["models"]
    for name, row in rows.items():
        meta = json.loads((DATA / f"{name}.json").read_text())
        assert (row["kind"], row["n_future"]) == (meta["model"]["kind"], meta["model"]["n_future"])
        assert row["trunk"]["n_trunk"] == meta["model"]["n_trunk"] and row["train_flops"] == meta["train_flops"]
        assert (row["steps"], row["precision"]) == (meta["train"]["steps"], meta["train"]["precision"])
        assert row["val_next_bits_per_byte"] == meta["val_next_bits_per_byte"]
        for key, same, gap in (("baseline", "data", "val_loss_vs_next"),
                               ("compute_baseline", "compute", "val_loss_vs_next_compute")):
            candidates = like_for_like(rows, row, same)
            assert len(candidates) <= 1, f"{name}: ambiguous equal-{same} baselines {candidates}"
            assert row.get(key) == (candidates[0] if candidates else None), name
            if row.get(key):
                ratio = row["val_next_bits_per_byte"] / rows[row[key]]["val_next_bits_per_byte"] - 1
                assert row[gap] == pytest.approx(ratio, abs=1e-12)
        if row["kind"] == "next":
            assert row["baseline"] == row["compute_baseline"] == name                  # a next-token model is its own
        else:
            assert row.get("baseline") or row.get("compute_baseline"), f"{name} is compared with nothing"
            if row.get("compute_baseline"):
                assert rows[row["compute_baseline"]]["steps"] > row["steps"]           # the heads' FLOPs bought steps
