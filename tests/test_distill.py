"""Self-distilled training text: prompts that are not benchmark questions, the target's greedy answers, resuming."""
import json

import pytest
from conftest import chatml_tokenizer

from labkit import autoregressive_generate
from labkit.heads.distill import (
    INSTRUCTIONS,
    QUESTIONS_DIR,
    benchmark_shingles,
    code_prompts,
    distill,
    distilled_sequences,
    read_records,
    shingles,
)
from labkit.models.loading import LoadedModel, encode_prompt


def prompt(i: int, text: str) -> dict:
    return {"id": f"p{i}", "source": "test", "messages": [{"role": "user", "content": text}]}


def test_a_prompt_quoting_a_benchmark_question_is_recognised():
    bench = benchmark_shingles()
    question = json.loads((QUESTIONS_DIR / "labkit_bench.jsonl").read_text().splitlines()[1])["turns"][0]
    assert shingles("Please help. " + question) & bench                 # a copy inside a longer prompt
    assert not shingles("Explain how a hash map resolves collisions with open addressing, briefly.") & bench


def test_no_instruction_itself_quotes_a_benchmark_question():
    """Else every code prompt with that instruction would be dropped as benchmark-like."""
    bench = benchmark_shingles()
    assert not [key for key, text in INSTRUCTIONS.items() if shingles(text) & bench]


def test_code_prompts_are_stdlib_functions_with_an_instruction():
    prompts = [p for _, p in zip(range(12), code_prompts(seed=0))]
    assert len({p["id"] for p in prompts}) == 12
    for p in prompts:
        text = p["messages"][0]["content"]
        instruction, code = text.split("\n\n```python\n")
        assert instruction in INSTRUCTIONS.values()
        compile(code.removesuffix("\n```"), p["id"], "exec")                            # a whole function


def test_answers_are_the_targets_greedy_ones_and_a_rerun_resumes(tiny_target, tmp_path):
    loaded = LoadedModel(tiny_target, chatml_tokenizer(), "tiny", "native", eos_token_ids=(1,))
    prompts = [prompt(0, "Write a loop."), prompt(1, "Sort a list, then print it."), prompt(2, "Hi")]
    out = tmp_path / "d.jsonl"
    records = distill(loaded, prompts[:2], out, max_new_tokens=6, batch_size=2, progress=False)
    assert [r["id"] for r in records] == ["p0", "p1"]
    for r in records:
        ids = encode_prompt(loaded.tokenizer, r["messages"], True)
        assert r["prompt_ids"] == ids.tolist()
        assert r["answer_ids"] == autoregressive_generate(tiny_target, ids, 6, eos_token_ids=(1,)).tokens
    first = out.read_text()
    records = distill(loaded, prompts, out, max_new_tokens=6, batch_size=2, progress=False)
    assert out.read_text().startswith(first) and [r["id"] for r in records] == ["p0", "p1", "p2"]


def test_conversations_pack_into_rows_in_order():
    records = [{"prompt_ids": [1, 2], "answer_ids": [3, 4, 5], "stop": "max_new_tokens"},
               {"prompt_ids": [6], "answer_ids": [7, 9], "stop": "eos"}]
    rows = distilled_sequences(records, seq_len=3, end_ids=(9,))
    assert [r.tolist() for r in rows] == [[1, 2, 3], [4, 5, 9], [6, 7, 9]]    # a cut answer gets an end of turn
    assert distilled_sequences(records, seq_len=20) == []


def test_bad_settings_are_refused(tiny_target, tmp_path):
    loaded = LoadedModel(tiny_target, chatml_tokenizer(), "tiny", "native", eos_token_ids=(1,))
    with pytest.raises(ValueError, match="batch_size"):
        distill(loaded, [prompt(0, "x")], tmp_path / "d.jsonl", batch_size=0, progress=False)
    assert read_records(tmp_path / "nothing.jsonl") == []
