"""The benchmark harness: question files, resume after a kill, the report's arithmetic, and a real tiny run."""
import json
import os

import pytest
import torch
from conftest import save_tiny_checkpoint, tiny_tokenizer

from labkit.bench import BenchConfig, read_questions, run_bench
from labkit.bench.methods import METHODS, VARIANTS, check_methods, default_methods, known, method, with_variants
from labkit.bench.questions import QuestionFileError
from labkit.bench.records import read_results
from labkit.bench.report import (
    ORACLE,
    aggregate,
    first_difference,
    ideal_speedup,
    load_run,
    oracle_picks,
)
from labkit.cli import main
from labkit.core.adaptive import expected_speedup


def write_lines(path, *objs):
    path.write_text("\n".join(o if isinstance(o, str) else json.dumps(o) for o in objs) + "\n")
    return path


Q1 = {"question_id": "a", "category": "coding", "turns": ["def f(x):", "second turn, unused"]}
Q2 = {"question_id": 2, "category": "rag", "turns": ["abc abc abc"]}


def test_reads_spec_bench_questions(tmp_path):
    qs = read_questions(write_lines(tmp_path / "q.jsonl", Q1, "", Q2))
    assert [(q.question_id, q.category, q.prompt) for q in qs] == [("a", "coding", "def f(x):"),
                                                                   ("2", "rag", "abc abc abc")]
    assert [q.question_id for q in read_questions(tmp_path / "q.jsonl", categories=["rag"])] == ["2"]
    assert len(read_questions(tmp_path / "q.jsonl", limit=1)) == 1


def test_shipped_question_files():
    qs = read_questions("data/questions/labkit_bench.jsonl")
    per_category = {c: sum(q.category == c for q in qs) for c in {q.category for q in qs}}
    assert len(per_category) == 7 and min(per_category.values()) >= 3
    assert len(read_questions("data/questions/tiny.jsonl")) == 2
    edits = read_questions("data/questions/code_edit.jsonl")
    assert len(edits) == 8 and all(q.category == "code-edit" and len(q.earlier) == 1 for q in edits)
    assert all("```" in q.earlier[0][1] and "Return the whole" in q.prompt for q in edits)   # code, then its edit


def test_a_question_with_answers_is_a_conversation_ending_with_its_last_turn(tmp_path):
    line = {"question_id": "e", "category": "code-edit", "turns": ["Write f.", "Rename it."], "answers": ["def f(): 1"]}
    q = read_questions(write_lines(tmp_path / "q.jsonl", line))[0]
    assert q.prompt == "Rename it." and [m["role"] for m in q.messages] == ["user", "assistant", "user"]
    plain = read_questions(write_lines(tmp_path / "p.jsonl", Q1))[0]
    assert plain.prompt == "def f(x):" and len(plain.messages) == 1       # Spec-Bench: the first turn only
    assert q.sha != read_questions(write_lines(tmp_path / "r.jsonl", {**line, "answers": ["def f(): 2"]}))[0].sha


@pytest.mark.parametrize("line, message", [
    ("{not json", ":1: not valid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"question_id": 1, "turns": ["x"]}', "missing category"),
    ('{"question_id": 1, "category": "qa", "turns": []}', "turns must be a non-empty list"),
    ('{"question_id": 1, "category": "qa", "turns": ["  "]}', "turns must be a non-empty list"),
    ('{"question_id": 1, "category": "", "turns": ["x"]}', "category must be a non-empty string"),
    ('{"question_id": 1, "category": "c", "turns": ["x", "y"], "answers": []}', "answers to every turn but the last"),
    ('{"question_id": 1, "category": "c", "turns": ["x", "y"], "answers": [" "]}', "1 non-empty strings for 2"),
])
def test_bad_question_lines_name_line_and_fix(tmp_path, line, message):
    with pytest.raises(QuestionFileError, match=message):
        read_questions(write_lines(tmp_path / "q.jsonl", line))


def test_bad_question_files(tmp_path):
    with pytest.raises(QuestionFileError, match="does not exist"):
        read_questions(tmp_path / "nope.jsonl")
    with pytest.raises(QuestionFileError, match="appears twice"):
        read_questions(write_lines(tmp_path / "dup.jsonl", Q1, Q1))
    with pytest.raises(QuestionFileError, match=r"categories \['math'\].*\['coding', 'rag'\]"):
        read_questions(write_lines(tmp_path / "q.jsonl", Q1, Q2), categories=["math"])
    with pytest.raises(QuestionFileError, match="holds no questions"):
        read_questions(write_lines(tmp_path / "empty.jsonl", ""))
    with pytest.raises(QuestionFileError, match="--limit"):
        read_questions(tmp_path / "q.jsonl", limit=0)


def test_method_choice_puts_baselines_first():
    assert check_methods(["lookup", "hf-assisted"]) == ["ar", "lookup", "hf-generate", "hf-assisted"]
    with pytest.raises(ValueError, match="unknown methods \\['hydra'\\]"):
        check_methods(["hydra"])
    with pytest.raises(ValueError, match="--methods names no method"):
        check_methods([])


def test_llama_cpp_methods_only_where_it_is_built(tmp_path, monkeypatch):
    from labkit.bench.methods import default_methods
    monkeypatch.setenv("LABKIT_LLAMA_CPP", str(tmp_path))            # an empty folder: not built
    assert not any(m.startswith("llama-cpp") for m in default_methods("qwen2.5-coder-1.5b-instruct"))
    with pytest.raises(ValueError, match="run `make llama-cpp`"):
        check_methods(["llama-cpp-draft"])
    for program in ("llama-completion", "llama-speculative-simple"):
        (tmp_path / program).write_text("#!/bin/sh\n")
        (tmp_path / program).chmod(0o755)
    assert check_methods(["llama-cpp-draft"]) == ["ar", "llama-cpp", "llama-cpp-draft"]
    assert "llama-cpp-draft" in default_methods("qwen2.5-coder-1.5b-instruct")
    assert "llama-cpp" not in default_methods("some/hub-model"), "llama.cpp reads the presets' GGUF files"


def test_a_quantized_target_runs_without_transformers_peers(tmp_path):
    """transformers has no labkit int4/int8 model: the default methods leave its peers out, and asking is refused."""
    quantized = default_methods("qwen2.5-coder-1.5b-instruct", "int4")
    assert "ar" in quantized and "draft" in quantized and not any(m.startswith("hf-") for m in quantized)
    assert "hf-generate" in default_methods("qwen2.5-coder-1.5b-instruct", "bf16")
    assert BenchConfig("data/questions/tiny.jsonl", str(tmp_path), dtype="int4").methods == \
        check_methods(default_methods("qwen2.5-coder-1.5b-instruct", "int4"))
    with pytest.raises(ValueError, match="hf-generate, hf-assisted run transformers' model.*--dtype int8"):
        BenchConfig("data/questions/tiny.jsonl", str(tmp_path), methods=["hf-assisted"], dtype="int8")


def test_the_draft_with_another_tokenizer_runs_for_other_presets_only():
    qwen = default_methods("qwen2.5-coder-1.5b-instruct")
    assert {"cross-tokenizer", "hf-assisted-uag"} <= set(qwen)
    assert "cross-tokenizer" not in default_methods("smollm2-135m-instruct")     # it is that draft itself
    assert "cross-tokenizer" not in default_methods("some/hub-model")


def test_a_results_line_that_is_not_a_record_is_an_error(tmp_path):
    from labkit.bench.records import DamagedResults, append
    f = tmp_path / "results.jsonl"
    meta = '{"run": "k", "meta": {}}\n'
    f.write_text(meta + '{"run": "k", "question_id": "q1"')         # the last line cut short by a kill: skipped
    assert read_results(f) == [{"run": "k", "meta": {}}]
    record = {"run": "k", "question_id": "q1", "question_sha": "s", "category": "c", "method": "ar", "reference": "ar",
              "exact": True, "new_tokens": 2, "seconds": 0.5, "tokens": [3, 4], "target_forwards": 2,
              "draft_time": None, "verify_time": 0.4, "steps": [[0, 0, 1, 0.0, 0.2], [0, 0, 1, 0.0, 0.2]]}
    append(f, record)                                                  # the cut-short line is dropped, not kept
    assert f.read_text() == meta + json.dumps(record) + "\n" and read_results(f)[1] == record
    for line in ('[1, 2]', '"text"', '{"run": "k", "method": "ar"}'):
        f.write_text(line + "\n")
        with pytest.raises(ValueError, match="results.jsonl:1 is JSON but not a benchmark record"):
            read_results(f)
    damaged = [("{not json", "results.jsonl:2 is damaged \\(not JSON"),                  # in the middle: not skipped
               ('{"run": "k", "meta": 3}', "results.jsonl:2 is a run's meta line whose meta is not"),
               (json.dumps({**record, "seconds": "NaN"}), 'results.jsonl:2 has seconds = "NaN"'),
               (json.dumps({**record, "seconds": float("nan")}), "results.jsonl:2 has seconds = NaN"),
               (json.dumps({**record, "seconds": -5}), "results.jsonl:2 has seconds = -5"),
               (json.dumps({**record, "new_tokens": 3}), "has new_tokens = 3 but 2 tokens"),
               (json.dumps({**record, "tokens": [3, -4]}), "has tokens = "),
               (json.dumps({**record, "steps": [[1, "a"]]}), "has steps = "),
               (json.dumps({**record, "run": 7}), "has a run key 7")]
    for line, message in damaged:
        f.write_text(meta + line + "\n" + json.dumps(record) + "\n")
        with pytest.raises(DamagedResults, match=message):
            read_results(f)
        assert read_results(f, skip_damaged=True)[-1] == record
    f.write_text("{damaged meta\n" + json.dumps(record) + "\n")
    with pytest.raises(DamagedResults, match="results.jsonl:1 is damaged"):
        read_results(f)
    with pytest.raises(ValueError, match="not a benchmark record, not written"):
        append(f, {**record, "seconds": -1.0})


# --- the report's arithmetic on records made up by hand -------------------------------------

def record(q, cat, method, tokens, seconds, forwards, steps, draft=0.0, verify=None, reference="ar"):
    return {"run": "k", "question_id": q, "question_sha": "s", "category": cat, "method": method,
            "reference": reference, "exact": True, "prompt_tokens": 5, "new_tokens": len(tokens), "tokens": tokens,
            "seconds": seconds, "target_forwards": forwards, "draft_time": draft,
            "verify_time": seconds / 2 if verify is None else verify, "steps": steps}


AR_STEPS = [[0, 0, 1, 0.0, 0.1]] * 3 + [[0, 0, 1, 0.0, 0.0]]       # 4 tokens, 0.1 s a decode step


def test_aggregate_arithmetic():
    spec_steps = [[3, 3, 1, 0.03, 0.12], [3, 1, 0, 0.03, 0.12]]     # 4 + 2 tokens, 4 of 6 drafts accepted
    records = [record("q1", "c1", "ar", [1, 2, 3, 4, 5, 6], 2.0, 6, AR_STEPS),
               record("q1", "c1", "draft", [1, 2, 3, 4, 5, 6], 1.0, 2, spec_steps, draft=0.06, verify=0.24),
               record("q2", "c2", "ar", [1, 2, 3, 4], 1.0, 4, AR_STEPS),
               record("q2", "c2", "draft", [1, 2, 9, 9], 0.25, 1, [[3, 2, 0, 0.03, 0.12]], draft=0.03, verify=0.12),
               record("q3", "c2", "draft", [1], 1.0, 1, [[3, 0, 0, 0.03, 0.12]])]   # no baseline: left out
    rows, mismatches = aggregate(records)
    row = {(r.category, r.method): r for r in rows}
    c1, c2, both = row["c1", "draft"], row["c2", "draft"], row["all", "draft"]
    assert c1.tokens_per_second == pytest.approx(6.0) and c1.speedup == pytest.approx(6.0 / 3.0)
    assert c1.tokens_per_forward == pytest.approx(3.0) and c1.acceptance_rate == pytest.approx(4 / 6)
    assert c1.draft_share == pytest.approx(0.06) and c1.verify_share == pytest.approx(0.24)
    assert c2.speedup == pytest.approx(16 / 4) and c2.same_as_baseline == 0 and c2.questions == 1
    assert both.questions == 2 and both.tokens_per_second == pytest.approx(10 / 1.25)
    assert both.speedup == pytest.approx((10 / 1.25) / (10 / 3.0))
    assert both.acceptance_rate == pytest.approx(6 / 9) and both.same_as_baseline == 1
    assert row["all", "ar"].speedup == 1 and row["all", "ar"].acceptance_rate is None
    assert [(m.question_id, m.method, m.first_difference) for m in mismatches] == [("q2", "draft", 2)]
    # Leviathan's formula with α = 4/(4+1), γ = 3, draft step 0.01/0.1, verify 0.12/0.1
    assert c1.ideal_speedup == pytest.approx(expected_speedup(0.8, 3, 0.1, 1.2))


def test_prefill_share_and_the_decode_phase_speedup():
    """A long prompt, a short answer: 3 s of prefill in both runs; the draft halves the decode (2 s -> 1 s), so the
    end-to-end speedup is 5/4 while the decode phase ran at 2x. A record without a prefill leaves both unknown."""
    records = [record("q1", "rag", "ar", [1, 2, 3, 4], 5.0, 4, AR_STEPS) | {"prefill_seconds": 3.0},
               record("q1", "rag", "draft", [1, 2, 3, 4], 4.0, 2, [[3, 3, 1, 0.03, 0.12]]) | {"prefill_seconds": 3.0},
               record("q1", "rag", "hf-generate", [1, 2, 3, 4], 6.0, 4, None, reference="hf-generate")]
    row = {(r.category, r.method): r for r in aggregate(records)[0]}
    draft = row["rag", "draft"]
    assert draft.speedup == pytest.approx(5 / 4) and draft.decode_speedup == pytest.approx(2.0)
    assert draft.prefill_share == pytest.approx(3 / 4) and row["rag", "ar"].prefill_share == pytest.approx(3 / 5)
    assert row["rag", "hf-generate"].prefill_share is None and row["rag", "hf-generate"].decode_speedup is None
    assert row["all", ORACLE].decode_speedup == pytest.approx(2.0)
    older = [{k: v for k, v in r.items() if k != "prefill_seconds"} for r in records]     # a run from before
    assert {r.decode_speedup for r in aggregate(older)[0]} == {None}


def test_speedup_over_the_methods_own_plain_decoder():
    records = [record("q1", "c1", "ar", [1, 2, 3, 4], 2.0, 4, AR_STEPS),
               record("q1", "c1", "hf-generate", [1, 2, 3, 4], 1.0, 4, None, reference="hf-generate"),
               record("q1", "c1", "hf-assisted", [1, 2, 3, 4], 0.8, 2, None, reference="hf-generate"),
               record("q1", "c1", "draft", [1, 2, 3, 4], 0.5, 2, [[3, 3, 1, 0.03, 0.12]])]
    row = {(r.category, r.method): r for r in aggregate(records)[0]}
    assert row["c1", "hf-assisted"].speedup == pytest.approx(2.0 / 0.8)
    assert row["c1", "hf-assisted"].speedup_over_reference == pytest.approx(1.0 / 0.8)
    assert row["c1", "draft"].speedup_over_reference == pytest.approx(4.0) == row["c1", "draft"].speedup
    without_own = aggregate([r for r in records if r["method"] != "hf-generate"])[0]
    assert {(r.method, r.speedup_over_reference) for r in without_own if r.category == "c1"} >= {("hf-assisted", None)}


def test_oracle_row_takes_the_fastest_labkit_method_per_question():
    records = [record("q1", "c1", "ar", [1, 2, 3, 4], 2.0, 4, AR_STEPS),
               record("q1", "c1", "draft", [1, 2, 3, 4], 1.0, 2, [[3, 3, 1, 0.03, 0.12]]),
               record("q1", "c1", "lookup", [1, 2, 3, 4], 0.5, 2, [[3, 3, 1, 0.0, 0.12]]),
               record("q1", "c1", "hf-generate", [1, 2, 3, 4], 0.1, 4, None, reference="hf-generate"),
               record("q2", "c2", "ar", [1, 2, 3, 4], 1.0, 4, AR_STEPS),
               record("q2", "c2", "draft", [1, 2, 9, 9], 0.4, 1, [[3, 2, 0, 0.03, 0.12]]),
               record("q2", "c2", "lookup", [1, 2, 3, 4], 2.0, 4, [[0, 0, 1, 0.0, 0.1]]),
               record("q2", "c2", "hf-generate", [1, 2, 3, 4], 0.1, 4, None, reference="hf-generate")]
    row = {(r.category, r.method): r for r in aggregate(records)[0]}
    oracle = row["all", ORACLE]
    # q1: lookup's 0.5 s, q2: draft's 0.4 s (another stack's faster generate does not count)
    assert oracle.tokens_per_second == pytest.approx(8 / 0.9) and oracle.speedup == pytest.approx(3.0 / 0.9)
    assert oracle.questions == 2 and oracle.same_as_baseline == 1          # q2's fastest parted from AR
    assert row["c2", ORACLE].speedup == pytest.approx(1.0 / 0.4)
    assert oracle_picks(records) == {"lookup": 1, "draft": 1}
    only_ar = [r for r in records if r["method"] == "ar"]
    assert ORACLE not in {r.method for r in aggregate(only_ar)[0]}        # no choice, no oracle


def test_the_paired_speedup_is_the_median_of_each_rounds_own_ratio():
    """Three rounds of two questions. In round 1 the machine ran fast for plain decoding's run of q1 alone: that run
    is q1's fastest and sets the speedup of fastest runs ((0.6 + 1.0) / (0.9 + 1.0) = 0.84x), while the rounds' own
    ratios are 1.0, 0.8 and 1.0 (in rounds 0 and 2 the draft's two runs took what plain decoding's did): median 1.0."""
    from labkit.bench.report import paired_speedup, summarise
    from labkit.bench.runner import best_runs
    seconds = {"ar": [(1.0, 1.0), (0.6, 1.0), (1.0, 1.0)], "draft": [(1.0, 1.0), (1.0, 1.0), (0.9, 1.1)]}
    runs = [record(q, "c1", m, [1, 2, 3, 4], seconds[m][k][i], 4, AR_STEPS) | {"repeat": k}
            for k in range(3) for i, q in enumerate(("q1", "q2")) for m in ("ar", "draft")]
    records = best_runs(runs)
    row = {(r.category, r.method): r for r in aggregate(records)[0]}
    draft = row["c1", "draft"]
    assert draft.speedup == pytest.approx(1.6 / 1.9)
    assert draft.paired_speedup == pytest.approx(1.0)
    assert (draft.paired_low, draft.paired_high) == (pytest.approx(1.6 / 2.0), pytest.approx(1.0))
    assert row["c1", "ar"].paired_speedup == pytest.approx(1.0) and row["all", ORACLE].paired_speedup is None
    md = summarise({"questions": "q.jsonl", "date": "d", "machine": "m", "target": "t", "draft": "d", "dtype": "bf16",
                    "max_new_tokens": 4, "gamma": 4, "repeats": 3}, aggregate(records)[0], [])
    assert "| c1 | draft | 2 | 4.21 | 0.84 | 1.00 (0.80-1.00) |" in md and "*× AR paired*" in md
    # only the rounds every question of both ran count; one such round, or a run of one round, pairs nothing
    assert paired_speedup([r for r in records if r["method"] == "draft"],
                          [r for r in records if r["method"] == "ar"]).rounds == 3
    cut = best_runs([r for r in runs if not (r["repeat"] == 2 and r["question_id"] == "q2")])
    assert paired_speedup([r for r in cut if r["method"] == "draft"],
                          [r for r in cut if r["method"] == "ar"]).rounds == 2
    one = best_runs([r for r in runs if r["repeat"] == 0])
    assert {r.paired_speedup for r in aggregate(one)[0]} == {None}
    assert paired_speedup([r for r in one if r["method"] == "draft"], [r for r in one if r["method"] == "ar"]) is None


def test_first_difference_and_ideal_edge_cases():
    assert first_difference([1, 2], [1, 2]) is None
    assert first_difference([1, 2], [1, 3]) == 1 and first_difference([1, 2], [1, 2, 3]) == 2
    assert ideal_speedup(AR_STEPS, AR_STEPS) is None                  # nothing drafted


def test_tree_methods_ideal_is_tokens_per_step_of_measured_cost():
    """A tree step has no single acceptance rate: 6 tokens over 0.4 s of drafting and verifying is 1.5 AR steps'
    worth of tokens per AR step; the record's tree flag comes from the registry."""
    steps = [[8, 3, 0, 0.01, 0.11], [0, 0, 1, 0.0, 0.1], [5, 1, 0, 0.01, 0.17]]   # 4 + 1 + 2 tokens in 0.4 s
    assert ideal_speedup(steps, AR_STEPS, tree=True) == pytest.approx(7 * 0.1 / 0.4)
    assert ideal_speedup(steps, AR_STEPS) != pytest.approx(7 * 0.1 / 0.4)       # the chain formula differs
    plain = [[2, 0, 0, 0.0, 0.1]]                                                  # 1 token in 0.1 s: ideal 1.0
    records = [record("q1", "c1", "ar", [1] * 7, 0.7, 7, AR_STEPS), record("q1", "c1", "suffix", [1] * 7, 0.5, 3, steps),
               record("q2", "c1", "ar", [1] * 7, 2.1, 7, AR_STEPS), record("q2", "c1", "suffix", [1], 2.0, 1, plain)]
    row = {(r.category, r.method): r for r in aggregate(records)[0]}
    assert ideal_speedup(plain, AR_STEPS, tree=True) == pytest.approx(1.0)
    # over questions a ratio of sums (as × AR is), not the mean of 1.75 and 1.0: (0.7 + 2.1) / (0.7 / 1.75 + 2.1 / 1)
    assert row["c1", "suffix"].ideal_speedup == pytest.approx(2.8 / 2.5)


# --- real runs on tiny random checkpoints ---------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target and a noisy copy of it as the draft: it agrees often, not always."""
    target, draft = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    hf = save_tiny_checkpoint(target, "qwen2", seed=0)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.3 * p.std().clamp(min=1e-3))
    hf.save_pretrained(draft)
    tiny_tokenizer().save_pretrained(draft)
    return str(target), str(draft)


def tiny_config(pair, out, **kw):
    return BenchConfig("data/questions/tiny.jsonl", str(out), target=pair[0], draft=pair[1], dtype="fp32",
                       max_new_tokens=12, gamma=3, chat_template=False, threads=1, **kw)


def test_resume_after_kill_redoes_nothing(pair, tmp_path, monkeypatch):
    config = tiny_config(pair, tmp_path, methods=["ar", "draft", "lookup"])
    calls = []
    build = METHODS["lookup"].build

    def build_dying_on_second_question(*args):
        run = build(*args)

        def wrapped(ids):
            calls.append(ids.numel())
            if len(calls) == 3:         # warm-up, question 1, then the kill on question 2
                raise KeyboardInterrupt
            return run(ids)
        return wrapped
    monkeypatch.setitem(METHODS, "lookup", METHODS["lookup"].__class__(
        **{**METHODS["lookup"].__dict__, "build": build_dying_on_second_question}))
    with pytest.raises(KeyboardInterrupt):
        run_bench(config, progress=False)
    first = [r for r in read_results(tmp_path / "results.jsonl") if "method" in r]
    assert [(r["question_id"], r["method"]) for r in first] == [      # the second question's order is rotated
        ("tiny-code", "ar"), ("tiny-code", "draft"), ("tiny-code", "lookup"), ("tiny-rag", "draft")]
    with (tmp_path / "results.jsonl").open("a") as f:
        f.write('{"run": "cut short by a ki')                          # a line a kill left half-written
    monkeypatch.undo()
    run_bench(config, progress=False)
    second = [r for r in read_results(tmp_path / "results.jsonl") if "method" in r]
    assert second[:4] == first and [(r["question_id"], r["method"]) for r in second[4:]] == [("tiny-rag", "lookup"),
                                                                                              ("tiny-rag", "ar")]
    _, records = load_run(tmp_path / "results.jsonl")
    assert len(records) == 6
    n_lines = len((tmp_path / "results.jsonl").read_text().splitlines())
    run_bench(config, progress=False)                                   # all done: nothing appended
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == n_lines
    other = tiny_config(pair, tmp_path, methods=["ar"], limit=1)
    other.max_new_tokens = 5                                            # new settings: refused unless asked for
    with pytest.raises(ValueError, match=r"holds a run with other settings \(max_new_tokens 12 there, 5 here; methods "
                                         r"ar,draft,lookup there, ar here; questions tiny.jsonl \(2 questions\) there, "
                                         r"tiny.jsonl \(1 questions\) here\).*--append.*--force"):
        run_bench(other, progress=False)
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == n_lines
    run_bench(other, progress=False, existing="append")                 # a new run key, measured beside the first
    assert len(load_run(tmp_path / "results.jsonl", other.run_key)[1]) == 1
    assert len(load_run(tmp_path / "results.jsonl", config.run_key)[1]) == 6
    run_bench(config, progress=False, existing="replace")               # afresh: the old runs are gone
    assert {r["run"] for r in read_results(tmp_path / "results.jsonl")} == {config.run_key}


def test_cli_end_to_end_exact_methods_equal_baseline(pair, tmp_path, capsys):
    code = main(["bench", "--questions", "data/questions/tiny.jsonl", "--limit", "1", "--target", pair[0],
                 "--draft", pair[1], "--dtype", "fp32", "--no-chat-template", "--max-new-tokens", "16",
                 "--gamma", "3", "--threads", "1", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    meta, records = load_run(tmp_path / "results.jsonl")
    by = {r["method"]: r for r in records}
    assert set(by) == set(default_methods(pair[0])) and {r["question_id"] for r in records} == {"tiny-code"}
    assert meta["draft_vocab"] == "auto" and meta["draft_vocab_auto"] is None and "window_rule" in meta  # no ranking
    assert meta["draft_opening_tokens"] == 0                                # no chat template: no opening to copy in
    assert "medusa" not in by                                                            # heads of another target
    assert all(len(r["tokens"]) == 16 or 1 in r["tokens"] for r in records)          # max_new_tokens or EOS
    for name, r in by.items():
        assert r["tokens"] == by[r["reference"]]["tokens"], name                        # fp32: exact, token for token
    assert by["draft"]["target_forwards"] < by["ar"]["target_forwards"]                # the draft agreed at times
    assert 0 < sum(s[1] for s in by["draft"]["steps"]) < sum(s[0] for s in by["draft"]["steps"])   # ... not always
    assert by["hf-generate"]["target_forwards"] == by["hf-generate"]["new_tokens"]      # one forward a token
    md = (tmp_path / "bench.md").read_text()
    assert "| all | labkit draft model, γ=3 |" in md and "None: every method" in md
    for name in ("bench.csv", "bench.json", "speedup_by_category.png", "accept_lengths.png"):
        assert (tmp_path / name).stat().st_size > 0
    (tmp_path / "bench.md").unlink()
    assert main(["bench", "--questions", "data/questions/tiny.jsonl", "--report-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "bench.md").read_text() == md
    assert main(["bench", "--report-only", "--out", str(tmp_path), "--report-out", str(tmp_path / "elsewhere"),
                 "--note", "a note"]) == 0                      # written where asked, the folder's report untouched
    assert "a note" in (tmp_path / "elsewhere" / "bench.md").read_text() and (tmp_path / "bench.md").read_text() == md
    capsys.readouterr()
    toy = ["bench", "--questions", "data/questions/tiny.jsonl", "--limit", "1", "--target", pair[0], "--draft", pair[1],
           "--dtype", "fp32", "--no-chat-template", "--max-new-tokens", "4", "--gamma", "3", "--threads", "1",
           "--methods", "ar", "--out", str(tmp_path)]
    assert main(toy) == 2 and "holds a run with other settings" in capsys.readouterr().err
    assert (tmp_path / "bench.md").read_text() == md            # a toy run replaces no report by accident
    assert main(toy + ["--append"]) == 0 and (tmp_path / "bench.md").read_text() != md


def test_one_bench_at_a_time_in_a_folder(pair, tmp_path):
    """A second bench on the same --out is refused at once (both would time their runs on the same cores)."""
    from labkit.bench.runner import locked
    config = tiny_config(pair, tmp_path, methods=["ar"], limit=1)
    with locked(tmp_path):
        with pytest.raises(ValueError, match=rf"a bench is already running in --out {tmp_path} \(pid {os.getpid()}\)"):
            run_bench(config, progress=False)
    run_bench(config, progress=False)                                  # free again: it runs
    assert not (tmp_path / ".bench.lock").exists()


def test_cli_bad_question_file(capsys, tmp_path):
    code = main(["bench", "--questions", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path)])
    assert code == 2 and "does not exist" in capsys.readouterr().err


def test_the_layer_skip_search_length_is_a_setting_that_keys_the_run(tmp_path):
    from labkit.bench.runner import BenchConfig
    from labkit.models.layer_skip import CALIBRATION_TOKENS
    q = str(tmp_path / "q.jsonl")
    default, shorter = BenchConfig(q, str(tmp_path), ["ar"]), BenchConfig(q, str(tmp_path), ["ar"], layer_skip_tokens=64)
    assert default.layer_skip_tokens == CALIBRATION_TOKENS and default.run_key != shorter.run_key
    assert BenchConfig(q, str(tmp_path), ["ar"], layer_skip_tokens=CALIBRATION_TOKENS).run_key == default.run_key
    with pytest.raises(ValueError, match="--layer-skip-tokens must be >= 16"):
        BenchConfig(q, str(tmp_path), ["ar"], layer_skip_tokens=8)


UNIT_METHODS = [n for n, m in METHODS.items() if m.needs <= {"draft"} and m.reference == "ar"]
UNIT_VARIANTS = [f"{m}-{v.name}" for v in VARIANTS.values() for m in v.of]


@pytest.mark.parametrize("name", UNIT_METHODS + UNIT_VARIANTS)
def test_every_registered_method_runs_and_the_exact_ones_equal_plain_decoding(pair, name):
    """Each line of METHODS that needs no trained head and no peer runs here on the tiny pair: one registry line
    puts a new method in the command line, the bench and this test."""
    from labkit.bench.runner import load_models
    from labkit.models.loading import encode_prompt
    config = tiny_config(pair, "unused", methods=[name], layer_skip_tokens=32)
    models = load_models(config, progress=False)
    prompt = encode_prompt(models.target.tokenizer, "def add(a, b):\n    return a + b\n\ndef add(a, b):", False)
    plain = METHODS["ar"].build(models, 12, 3, 10)(prompt)
    out = method(name).build(models, 12, 3, 10)(prompt)
    assert len(out.tokens) == len(plain.tokens) and out.generation is not None
    if method(name).exact:
        assert out.tokens == plain.tokens
    assert out.target_forwards <= len(out.tokens) and out.generation.trace.n_generated == len(out.tokens)


def test_the_unit_tier_covers_every_method_without_a_head_or_a_peer():
    assert {"ar", "draft", "lookup", "suffix", "lookahead", "layer-skip"} <= set(UNIT_METHODS)
    rest = set(METHODS) - set(UNIT_METHODS)
    assert all(METHODS[n].needs - {"draft"} for n in rest), "the others need heads, a peer or a second tokenizer"


def test_the_method_order_rotates_from_question_to_question():
    """No method always runs first: over as many questions as methods, each runs once in every position."""
    from labkit.bench.runner import rotated
    methods = ["ar", "draft", "lookup"]
    orders = [rotated(methods, i) for i in range(6)]
    assert orders[:3] == [["ar", "draft", "lookup"], ["draft", "lookup", "ar"], ["lookup", "ar", "draft"]]
    assert orders[3:] == orders[:3]
    assert all(sorted(o) == sorted(methods) for o in orders)
    assert rotated([], 4) == []


def test_repeats_run_in_rounds_and_the_fastest_run_counts(pair, tmp_path):
    from labkit.bench import write_report
    config = tiny_config(pair, tmp_path, methods=["ar", "lookup"], limit=1, repeats=2)
    run_bench(config, progress=False)
    runs = [r for r in read_results(tmp_path / "results.jsonl") if "method" in r]
    assert [(r["method"], r["repeat"]) for r in runs] == [("ar", 0), ("lookup", 0), ("lookup", 1), ("ar", 1)]
    assert runs[0]["tokens"] == runs[3]["tokens"]                      # greedy: every repeat decodes the same
    _, records = load_run(tmp_path / "results.jsonl")
    for r in records:
        mine = [x["seconds"] for x in runs if x["method"] == r["method"]]
        assert r["runs"] == 2 and r["seconds_runs"] == mine and r["seconds"] == min(mine)
    config.repeats = 3                                                 # a third round: only it runs
    run_bench(config, progress=False)
    assert [r.get("repeat") for r in read_results(tmp_path / "results.jsonl") if "method" in r][4:] == [2, 2]
    assert {r["runs"] for r in load_run(tmp_path / "results.jsonl")[1]} == {3}
    write_report(tmp_path / "results.jsonl", config.run_key)
    md = (tmp_path / "bench.md").read_text()
    assert "each ran 3 times in rounds back to back and the fastest run counts" in md
    spread = json.loads((tmp_path / "bench.json").read_text())["meta"]["repeat_spread"]
    assert spread["pairs"] == 2 and 1 <= spread["median"] <= spread["max"] and f"{spread['max'] - 1:.0%} at the most" in md
    with pytest.raises(ValueError, match="--repeats must be >= 1"):
        tiny_config(pair, tmp_path, methods=["ar"], repeats=0)


def test_the_gated_method_drafts_a_request_only_where_its_categorys_last_drafted_one_paid(pair, tmp_path):
    """One DraftGate per category and round: each request's choice follows from the verdicts before it, plain
    requests decode plain, and every output equals plain decoding's."""
    from labkit.bench import write_report
    from labkit.tuning.gate import DraftGate, Verdict
    questions = write_lines(tmp_path / "q.jsonl", *[{"question_id": f"q{i}", "category": "code",
                                                     "turns": [f"def f{i}(x):\n    return x + {i}\n\ndef g("]}
                                                    for i in range(5)])
    config = tiny_config(pair, tmp_path, methods=["ar", "draft-cost-aware-gated"], repeats=2)
    config.questions = str(questions)
    run_bench(config, progress=False)
    runs = [r for r in read_results(tmp_path / "results.jsonl") if "method" in r]
    plain = {r["question_id"]: r["tokens"] for r in runs if r["method"] == "ar"}
    for repeat in (0, 1):
        gated = [r for r in runs if r["method"] == "draft-cost-aware-gated" and r["repeat"] == repeat]
        gate = DraftGate()
        assert len(gated) == 5 and gated[0]["gate"]["drafted"]              # each round starts afresh: it drafts
        for r in gated:
            assert r["tokens"] == plain[r["question_id"]]
            assert r["gate"]["drafted"] == gate.drafts()
            if r["gate"]["drafted"]:
                g = r["gate"]
                assert g["paid"] == (g["seconds"] < g["plain_seconds"])
                gate.record(Verdict(g["seconds"], g["plain_seconds"]))
            else:
                assert all(s[0] == 0 for s in r["steps"]) and r["draft_time"] == 0
                gate.record(None)
    _, counted = load_run(tmp_path / "results.jsonl")
    n = sum(r["gate"]["drafted"] for r in counted if r["method"] == "draft-cost-aware-gated")
    paid = sum(bool(r["gate"].get("paid")) for r in counted if r["method"] == "draft-cost-aware-gated")
    write_report(tmp_path / "results.jsonl", config.run_key)
    assert (f"labkit draft, cost-aware γ, gated per category drafted {n} questions ({paid} of them paid) and ran "
            f"{5 - n} plain") in (tmp_path / "bench.md").read_text()


def test_the_readme_counts_the_registry_s_methods():
    """The README's count of the bench's methods is the registry's, so a method added is a method said."""
    import re
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    said = re.search(r"the bench's (\d+) methods", readme)
    assert said and int(said.group(1)) == len(METHODS), (said and said.group(0), len(METHODS))


def test_every_method_a_command_in_the_docs_names_is_registered():
    """`--method X` and `--methods X,Y` in the README, docs, notebooks, scripts and the results' READMEs name
    registered methods, so a method renamed or removed leaves no command that no longer runs."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    files = [root / "README.md", root / "Makefile", *root.glob("docs/*.md"), *root.glob("notebooks/*.ipynb"),
             *root.glob("scripts/*.py"), *root.glob("data/bench/**/README.md")]
    unknown = {}
    for path in files:
        commands = [line for line in path.read_text().splitlines() if "error:" not in line]   # not the errors quoted
        for names in re.findall(r"--methods? ([a-z0-9][a-z0-9,-]*)", "\n".join(commands)):
            if names == "out":                                 # "leave --methods out"
                continue
            missing = [n for n in names.split(",") if not known(n)]
            if missing:
                unknown.setdefault(str(path.relative_to(root)), []).extend(missing)
    assert len(files) > 10 and not unknown, unknown


def test_a_variant_runs_beside_the_method_it_varies_with_one_choice_changed(pair):
    """`bench --variant`: each ablation is the method with one speed choice off, named METHOD-VARIANT, run after it;
    a variant of a method it does not vary, or an unknown one, is refused with what would run."""
    assert with_variants(["ar", "draft-cost-aware", "lookup"], ["whole", "gated"]) == \
        ["ar", "draft-cost-aware", "draft-cost-aware-whole", "draft-cost-aware-gated", "lookup"]
    assert check_methods(["draft-cost-aware-whole", "lookup", "draft-cost-aware"]) == \
        ["ar", "draft-cost-aware", "draft-cost-aware-whole", "lookup"]
    with pytest.raises(ValueError, match="varies none of the chosen methods: it varies gated: draft-cost-aware"):
        with_variants(["lookup"], ["gated"])
    with pytest.raises(ValueError, match="unknown variants"):
        with_variants(["draft"], ["faster"])
    assert not known("lookup-gated") and known("draft-rereads")
    gated, whole = method("draft-cost-aware-gated"), method("draft-cost-aware-whole")
    assert gated.per_workload and not METHODS["draft-cost-aware"].per_workload
    assert whole.label == "labkit draft, cost-aware γ, reading the whole context" and whole.policy is \
        METHODS["draft-cost-aware"].policy
    from labkit.bench.runner import load_models
    models = load_models(tiny_config(pair, "unused", methods=["draft"]), progress=False)
    models.draft_window, models.draft_vocab = 8, torch.arange(16)
    def reads(drafter):
        return getattr(drafter.reading, "window", None), hasattr(drafter.reading, "head")
    assert reads(METHODS["draft"].drafter(models, 12)) == (8, True)
    for name, kept in (("whole", (None, True)), ("all-ids", (8, False))):
        assert reads(method(f"draft-{name}").drafter(models, 12)) == kept, name
    assert set(VARIANTS) == {"gated", "all-ids", "whole", "rereads"}


def test_the_benchmark_page_names_every_method_and_variant():
    """docs/benchmark.md lists the registry's methods and variants by name: a method added is a method described."""
    from pathlib import Path
    page = (Path(__file__).resolve().parents[1] / "docs" / "benchmark.md").read_text()
    missing = [n for n in [*METHODS, *VARIANTS] if f"`{n}`" not in page]
    assert not missing, f"docs/benchmark.md does not name {missing}"
