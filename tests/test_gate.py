"""Drafting across a workload's requests: a request drafts only where drafting paid on the last drafted one."""
import pytest
import torch
from conftest import tiny_model

from labkit import DraftModelDrafter, autoregressive_generate, speculative_generate
from labkit.core.trace import Step, Trace
from labkit.tuning.gate import DraftGate, Verdict, drafting_paid, one_token_step

LOST, PAID = Verdict(seconds=2.0, plain_seconds=1.5), Verdict(seconds=1.0, plain_seconds=1.5)


def drive(gate: DraftGate, verdicts: list[Verdict]) -> str:
    """Run requests until `verdicts` are used up: D for a drafted request (taking the next verdict), p for plain."""
    out, verdicts = "", list(verdicts)
    while verdicts:
        if gate.drafts():
            gate.record(verdicts.pop(0))
            out += "D"
        else:
            gate.record(None)
            out += "p"
    return out


def test_a_workload_where_drafting_loses_waits_longer_after_each_try_and_one_that_pays_drafts_every_request():
    assert drive(DraftGate(retry=2), [LOST] * 4) == "Dpp" + "Dpppp" + "Dpppppppp" + "D"
    assert drive(DraftGate(retry=2), [PAID] * 3) == "DDD"
    gate = DraftGate(retry=1)
    assert drive(gate, [LOST, LOST, PAID, LOST]) == "Dp" + "Dpp" + "D" + "D"    # a request that pays resets the wait
    assert not gate.drafts() and gate.history == [False, None, False, None, None, True, False]
    assert gate.describe() == "7 requests: 4 drafted (1 paid), 3 plain"
    assert LOST.speedup == pytest.approx(0.75) and not LOST.paid and PAID.paid


def test_a_gate_says_what_to_record_and_what_retry_means():
    with pytest.raises(ValueError, match="retry is a number of plain requests >= 1"):
        DraftGate(retry=0)
    gate = DraftGate()
    with pytest.raises(ValueError, match="record its drafting_paid verdict"):
        gate.record(None)
    gate.record(LOST)
    with pytest.raises(ValueError, match="2 plain requests left"):
        gate.record(PAID)
    with pytest.raises(ValueError, match="one-token step in seconds, > 0"):
        drafting_paid(Trace("x", 3), 0.0)


def test_the_verdict_counts_the_drafts_reading_of_the_prompt_against_plain_decoding_of_the_same_tokens(tiny_target):
    prompt = torch.arange(3, 40)
    draft = tiny_model(seed=5)                                          # another model: it rarely agrees
    out = speculative_generate(tiny_target, DraftModelDrafter(draft), prompt, max_new_tokens=12, gamma=3)
    t = out.trace
    assert 0 < t.draft_prefill_time < t.prefill_time                   # the draft read the prompt after the target
    assert autoregressive_generate(tiny_target, prompt, 12).trace.draft_prefill_time == 0
    verdict = drafting_paid(t, step_seconds=0.01)
    assert verdict.seconds == t.total_time
    assert verdict.plain_seconds == pytest.approx(t.prefill_time - t.draft_prefill_time + 11 * 0.01)
    assert drafting_paid(t, step_seconds=1e3).paid and not drafting_paid(t, step_seconds=1e-9).paid


def test_the_one_token_step_is_read_off_the_runs_own_verifies_through_the_verify_curve():
    trace = Trace("x", 5, steps=[Step([1, 2], 2, 3, True, 0.01, 0.5),          # the first: the draft alone, left out
                                 Step([1, 2], 0, 3, False, 0.01, 0.30),       # 3 tokens: t(3)/t(1) = 1.5
                                 Step([], 0, 3, True, 0.0, 0.21),
                                 Step([1], 0, 3, False, 0.01, 0.24),          # 2 tokens: 1.2
                                 Step([1, 2, 3], 0, 3, False, 0.01, 0.32)])   # 4 tokens: 1.6
    curve = {1: 1.0, 2: 1.2, 4: 1.6}                                           # 3 tokens: 1.4, between its points
    assert one_token_step(trace, curve) == pytest.approx(0.205)                # median of 0.214, 0.21, 0.20, 0.20
    assert one_token_step(Trace("x", 5, steps=trace.steps[:1]), curve) is None
