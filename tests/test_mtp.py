"""Multi-token prediction: the head-by-head loss equals the naive one, self-speculative greedy decoding equals
the model's own greedy decoding, and the shipped checkpoints reproduce their recorded validation loss."""
import json
from pathlib import Path

import pytest
import torch

from labkit import SamplingConfig, autoregressive_generate, speculative_generate
from labkit.drafters.mtp import self_speculative
from labkit.mtp.data import fixed_windows
from labkit.mtp.loss import evaluate, headwise_backward, naive_backward
from labkit.mtp.model import MTPConfig, MTPModel
from labkit.mtp.train import WINDOW_EXTRA, load_checkpoint, train
from conftest import tiny_mtp

DATA = Path(__file__).resolve().parents[1] / "data" / "mtp"
SHIPPED = ["gloeckle4", "deepseek3", "gloeckle8", "gloeckle4_w01", "gloeckle4_600", "gloeckle4_w01_600", "deepseek3_600",
           "gloeckle4_w01_600_t10", "gloeckle4_w005_600_t10"]
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


def test_sampling_runs_and_stays_in_vocabulary():
    model = tiny_mtp("gloeckle", 4, scale=2.0).eval().requires_grad_(False)
    out = speculative_generate(*self_speculative(model), PROMPTS[0], 30, gamma=3,
                               sampling=SamplingConfig(temperature=0.8, top_k=20), seed=0)
    assert len(out.tokens) == 30 and all(0 <= t < 256 for t in out.tokens)


def shipped(name):
    if not (DATA / f"{name}.safetensors").exists():
        pytest.fail(f"data/mtp/{name}.safetensors is missing: run `make train-mtp`")
    return load_checkpoint(DATA / name)


@pytest.mark.parametrize("name", ["next", "next_600", "next_988", "next_1041", "next_778_t10"] + SHIPPED)
def test_shipped_checkpoint_reproduces_its_validation_loss(name):
    model, meta = shipped(name)
    T = meta["train"]["seq_len"]
    heldout = torch.frombuffer(bytearray((DATA / "heldout.txt").read_bytes()), dtype=torch.uint8)
    windows = fixed_windows(heldout, meta["val_slice_windows"], T + WINDOW_EXTRA)
    assert evaluate(model, windows, T) == pytest.approx(meta["val_slice_loss_nats"], rel=2e-3)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_checkpoint_greedy_self_speculative_equals_autoregressive(name):
    model, meta = shipped(name)
    prompts = json.loads((DATA / "results.json").read_text())["prompts"][:2]
    for text in prompts:
        prompt = torch.tensor(list(text.encode("latin-1")))
        ref = autoregressive_generate(model, prompt, max_new_tokens=96)
        out = speculative_generate(*self_speculative(model), prompt, max_new_tokens=96, gamma=model.cfg.n_future - 1)
        assert out.tokens == ref.tokens
        assert out.trace.tokens_per_forward > 1.3, "a trained model's heads should get drafts accepted"


def test_committed_loss_comparisons_are_like_for_like():
    """results.md compares each model with next-token-only models of the same trunk: at equal data (same steps and
    precision) and at equal compute (training FLOPs within 2%), read back from the shipped checkpoints' records."""
    rows = json.loads((DATA / "results.json").read_text())["models"]
    assert set(rows) >= set(SHIPPED)
    for name, row in rows.items():
        meta = json.loads((DATA / f"{name}.json").read_text())
        assert row["trunk"]["n_trunk"] == meta["model"]["n_trunk"] and row["train_flops"] == meta["train_flops"]
        for key in ("baseline", "compute_baseline"):
            if row.get(key):
                base = rows[row[key]]
                assert base["kind"] == "next" and base["trunk"] == row["trunk"] and base["precision"] == row["precision"]
        if row.get("baseline"):
            assert rows[row["baseline"]]["steps"] == row["steps"]
        if row.get("compute_baseline"):
            assert rows[row["compute_baseline"]]["train_flops"] == pytest.approx(row["train_flops"], rel=0.02)
            if row["kind"] != "next":                                              # a next-token model is its own
                assert rows[row["compute_baseline"]]["steps"] > row["steps"]       # the heads' FLOPs bought steps
    assert rows["gloeckle4_w01_600_t10"]["compute_baseline"] == rows["gloeckle4_w005_600_t10"]["compute_baseline"] \
        == "next_778_t10"
    assert rows["gloeckle4_w01_600"]["compute_baseline"] == "next_988"
