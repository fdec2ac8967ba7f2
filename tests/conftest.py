"""Shared fixtures: tiny random models the tests make themselves, so the unit tier runs in seconds.

The real pair (Qwen2.5-Coder 1.5B / 0.5B) is used by tests marked `integration`.
"""
from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

from labkit.models.mtp import MTPConfig, MTPModel
from labkit.models.transformer import ModelArgs, Transformer

# device="auto" (the CLI's, the bench's, load_model's) means the CPU in these tests on any machine: their tiny models
# and the CPU paths they check; the CUDA tests put their models on the GPU themselves
os.environ.setdefault("LABKIT_DEVICE", "cpu")


def _import_triton_interpreted() -> None:
    """Without a GPU, import Triton (and tests/test_kernels.py's kernels) in interpreter mode.

    Triton picks the interpreter when a function is decorated, its own library included, so
    TRITON_INTERPRET=1 must be set before Triton's first import; it is unset right after, so
    no subprocess or other test sees it (labkit only runs the kernels on CUDA tensors).
    """
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") is not None:
        return
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import labkit.kernels.acceptance  # noqa: F401
        import labkit.kernels.cache_attention  # noqa: F401
        import labkit.kernels.tree_attention  # noqa: F401
    finally:
        del os.environ["TRITON_INTERPRET"]


_import_triton_interpreted()


@pytest.fixture
def triton_interpreter(monkeypatch):
    """Triton's interpreter also reads TRITON_INTERPRET while a kernel runs: set it for the tests that ask (without
    a GPU), never for other tests."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")

TINY = dict(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, qkv_bias=True,
            tie_embeddings=True, max_seq_len=256)


def tiny_model(seed: int = 0, std: float = 0.15, **overrides) -> Transformer:
    """A random Qwen2-like model; std large enough that its next-token distributions are peaked."""
    return Transformer(ModelArgs(**{**TINY, **overrides})).init_random(std=std, seed=seed).eval().requires_grad_(False)


class PatternOfSteps:
    """A policy's choices by step, cycling (0: a plain step), driven by the steps taken, not by how often it is
    asked, so an eager loop and a compiled one (which asks once for a run of plain steps) take the same steps; it
    knows its coming plain steps (`plain_steps`), as the cost-aware policies do."""

    def __init__(self, pattern: list[int]):
        self.pattern, self.seen = pattern, 0

    def now(self) -> int:
        return self.pattern[self.seen % len(self.pattern)]

    def update(self, step) -> None:
        self.seen += 1

    def plain_steps(self) -> int:
        n = 0
        while n < len(self.pattern) and self.pattern[(self.seen + n) % len(self.pattern)] == 0:
            n += 1
        return max(1, n)


def host_syncs(fn) -> int:
    """How many times fn makes the host wait for the GPU (torch's sync debug mode: .item(), .tolist(), a copy from
    ordinary memory, a 0-d tensor used as an index...)."""
    import warnings
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def perturbed(model: Transformer, scale: float, seed: int = 1) -> Transformer:
    """A copy of `model` with Gaussian noise on every weight: a draft that agrees with it only partly."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp(min=1e-3))
    return draft


def tiny_mtp(kind: str, n: int, seed: int = 0, scale: float = 8.0) -> MTPModel:
    """A random multi-token model; weights scaled up so its greedy choices are not ties."""
    torch.manual_seed(seed)
    model = MTPModel(MTPConfig(kind=kind, n_future=n, dim=64, n_heads=4, hidden_dim=96, n_trunk=2, max_seq_len=128))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return model


@pytest.fixture(scope="module")
def one_thread():
    """The multi-token models are tiny: one thread is fastest, and on a busy machine two threads spin-wait."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_target() -> Transformer:
    return tiny_model(seed=0)


@pytest.fixture(scope="session")
def tiny_draft(tiny_target) -> Transformer:
    return perturbed(tiny_target, scale=0.5)


def require_shipped(path, remedy: str) -> None:
    """A test that reads a shipped file fails when it is missing; LABKIT_WEIGHTS_ABSENT=1 skips it instead, for a
    copy of the repository the shipped weights could not travel with (the GPU check's unit tier: a 64 MiB limit)."""
    if Path(path).exists():
        return
    if os.environ.get("LABKIT_WEIGHTS_ABSENT") == "1":
        pytest.skip(f"{Path(path).name} is not in this copy (LABKIT_WEIGHTS_ABSENT=1)")
    pytest.fail(f"{path} is missing: {remedy}")


TIERS = ("parallel", "serial")


def runs_alone(item) -> bool:
    """Tests that must have the machine to themselves: the real models (integration), the notebooks (their stored
    prose compares timings measured as they run) and tests marked serial (a timing bound)."""
    return "integration" in item.keywords or "serial" in item.keywords or item.path.suffix == ".ipynb"


def pytest_collection_modifyitems(config, items):
    """LABKIT_TIER=parallel keeps the tests that may share the machine (make test runs them on two workers),
    LABKIT_TIER=serial the others; unset, both. The integration tier runs only with LABKIT_INTEGRATION=1."""
    tier = os.environ.get("LABKIT_TIER", "")
    if tier and tier not in TIERS:
        raise pytest.UsageError(f"LABKIT_TIER={tier!r}: use parallel, serial or leave it unset (every test)")
    if tier:
        keep = [item for item in items if runs_alone(item) == (tier == "serial")]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
    if os.environ.get("LABKIT_INTEGRATION") == "1":
        return
    skip = pytest.mark.skip(reason="integration tier: set LABKIT_INTEGRATION=1 (make test does)")
    for item in items:
        if "integration" in item.keywords:
            item.add_marker(skip)


def save_tiny_checkpoint(path, model_type: str = "qwen2", vocab_size: int = 128, seed: int = 0, **cfg):
    """A random transformers checkpoint with a character-level tokenizer, saved like a Hub model."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
    config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[model_type]
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256)
    config = config_cls(vocab_size=vocab_size, tie_word_embeddings=model_type == "qwen2", eos_token_id=1,
                        bos_token_id=0, **({"attention_bias": True} if model_type == "llama" else {}),
                        **{**shape, **cfg})
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in hf.parameters():   # larger weights than the default init: peaked distributions
            p.normal_(0, 0.15) if p.dim() > 1 else p.normal_(1.0 if p.dim() == 1 and p.shape[0] == config.hidden_size else 0, 0.05)
    hf.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return hf.eval()


def tiny_tokenizer():
    """Byte-level BPE with no merges: one token per character, which Qwen2's tokenizer class reloads as is."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    chars = list(string.ascii_letters + string.digits + ".,:;!?()[]{}=+-*/_'\"#<>") + ["Ġ", "Ċ"]   # Ġ space, Ċ newline
    tok = Tokenizer(models.BPE({"<s>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(chars)}}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def chatml_tokenizer():
    """tiny_tokenizer with ChatML's two control tokens and a ChatML chat template, as Qwen's."""
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok
