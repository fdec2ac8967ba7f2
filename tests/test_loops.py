"""Which loop decodes a request (labkit/decoding/loops.py): the choice, its reasons, and the compiled loops' output
equal to the eager loops' through the one entry point the command line and the bench use."""
import pytest
import torch
from conftest import perturbed, tiny_model

from labkit import (
    DraftModelDrafter,
    FixedGamma,
    PromptLookupDrafter,
    SamplingConfig,
    SuffixDrafter,
)
from labkit.core.tree_budget import FixedBudget
from labkit.decoding.loops import choose_loop, decode, why_not_compiled
from labkit.decoding.static import StaticDecoder
from labkit.drafters import Windowed
from labkit.models.checks import check_load_args, resolve_dtype
from labkit.tuning import CostAwareGamma

PROMPT = torch.tensor([5, 17, 33, 2, 9, 5, 17, 33])
GREEDY, SAMPLED = SamplingConfig(), SamplingConfig(temperature=1.0)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(seed=0)
    return target, perturbed(target, scale=0.3)


def test_a_cpu_decodes_on_the_eager_loop_by_default_and_says_why(pair):
    target, draft = pair
    assert choose_loop(target, DraftModelDrafter(draft), 4) == \
        ("eager", "on a CPU, where launching a kernel costs little")
    assert choose_loop(target, None, 4, loop="compiled") == ("compiled", "asked for")
    with pytest.raises(ValueError, match="loop must be one of"):
        choose_loop(target, None, 4, loop="fast")


def test_what_keeps_a_request_off_the_compiled_loop(pair):
    target, draft = pair
    assert why_not_compiled(target, None, 4, GREEDY, False) is None
    assert why_not_compiled(target, DraftModelDrafter(draft), 8, SAMPLED, False) is None
    assert why_not_compiled(target, SuffixDrafter(), 64, GREEDY, True) is None
    reasons = [why_not_compiled(target, None, 4, SAMPLED, False),
               why_not_compiled(target, DraftModelDrafter(Windowed(draft, 16)), 4, GREEDY, False),
               why_not_compiled(target, DraftModelDrafter(draft, eos_token_ids=(3,)), 4, GREEDY, False),
               why_not_compiled(target, PromptLookupDrafter(), 9, GREEDY, False),
               why_not_compiled(target, PromptLookupDrafter(), CostAwareGamma(4), GREEDY, False),
               why_not_compiled(target, SuffixDrafter(), 65, GREEDY, True),
               why_not_compiled(target, DraftModelDrafter(draft), FixedBudget(24), SAMPLED, True)]
    assert [r is not None for r in reasons] == [True] * 7
    assert "greedily" in reasons[0] and "window" in reasons[1] and "up to 9" in reasons[3]
    assert "max_gamma <= 8" in reasons[4] and "65 nodes" in reasons[5] and "samples its tokens" in reasons[6]
    assert why_not_compiled(target, SuffixDrafter(), FixedBudget(24), SAMPLED, True) is None      # top-k picks
    assert why_not_compiled(target, PromptLookupDrafter(), CostAwareGamma(4, max_gamma=8), GREEDY, False) is None
    with pytest.raises(ValueError, match="cannot decode this request: .*window.*loop='eager'"):
        decode(target, DraftModelDrafter(Windowed(draft, 16)), PROMPT, 8, loop="compiled")


@pytest.mark.parametrize("which", ["plain", "draft", "lookup-policy", "suffix-tree", "sampled"])
def test_the_compiled_loop_decodes_what_the_eager_loop_decodes(pair, which):
    target, draft = pair
    drafter, gamma, sampling, tree = {
        "plain": (None, 4, GREEDY, False),
        "draft": (DraftModelDrafter(draft), 5, GREEDY, False),
        "lookup-policy": (PromptLookupDrafter(), FixedGamma(3), GREEDY, False),
        "suffix-tree": (SuffixDrafter(), 20, GREEDY, True),
        "sampled": (DraftModelDrafter(draft), 4, SamplingConfig(temperature=1.0, top_k=20), False)}[which]
    eager, loop = decode(target, drafter, PROMPT, 20, gamma, sampling, seed=3, tree=tree)
    assert loop[0] == "eager"
    for _ in range(2):                                   # the second request reuses the kept compiled decoder
        fast, loop = decode(target, drafter, PROMPT, 20, gamma, sampling, seed=3, tree=tree, loop="compiled",
                            compile_backend="eager")      # on a CPU a seed draws what the eager loop draws
        assert loop == ("compiled", "asked for") and fast.tokens == eager.tokens


def test_the_compiled_plain_loop_stops_at_eos(pair):
    target, _ = pair
    tokens = StaticDecoder(target, max_len=64).generate(PROMPT, 20).tokens
    eos = tokens[6]
    out = StaticDecoder(target, max_len=64).generate(PROMPT, 20, eos_token_ids=(eos,))
    assert out.tokens == tokens[:tokens.index(eos) + 1] and out.trace.stop_reason == "eos"


def test_dtype_auto_is_bf16_on_a_cpu_and_quantized_weights_stay_on_it():
    assert resolve_dtype("auto", "cpu") == "bf16" and resolve_dtype("fp32", "cuda") == "fp32"
    assert check_load_args("auto", "auto", "cpu") == ("cpu", None)
    with pytest.raises(ValueError, match="dtype must be one of"):
        check_load_args("int3", "auto", "cpu")


def test_labkit_device_says_what_auto_means(monkeypatch):
    monkeypatch.setenv("LABKIT_DEVICE", "cpu")                      # the CPU of a GPU machine, too
    assert check_load_args("fp32", "auto", "auto") == ("cpu", None)
    monkeypatch.setenv("LABKIT_DEVICE", "")                         # unset: the GPU where torch sees one
    assert check_load_args("fp32", "auto", "auto")[0] == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv("LABKIT_DEVICE", "gpu")
    with pytest.raises(ValueError, match="LABKIT_DEVICE must be cpu or cuda"):
        check_load_args("fp32", "auto", "auto")
    if not torch.cuda.is_available():
        monkeypatch.setenv("LABKIT_DEVICE", "cuda")
        with pytest.raises(ValueError, match="LABKIT_DEVICE=cuda but torch sees no GPU"):
            check_load_args("fp32", "auto", "auto")
