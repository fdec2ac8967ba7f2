"""Self-distilled training text: prompts that are not benchmark questions, the target's greedy answers, resuming."""
import json

import pytest
from conftest import chatml_tokenizer

from labkit import autoregressive_generate
from labkit.models.loading import LoadedModel, encode_prompt
from labkit.training.distill import (
    INSTRUCTIONS,
    QUESTIONS_DIR,
    benchmark_shingles,
    code_prompts,
    distill,
    distilled_sequences,
    heldout_split,
    read_records,
    shingles,
    ship,
)


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


def test_the_shipped_corpus_carries_the_answers_as_text_and_packs_as_the_cached_one(tiny_target, tmp_path):
    loaded = LoadedModel(tiny_target, chatml_tokenizer(), "tiny", "native", eos_token_ids=(1,))
    records = distill(loaded, [prompt(0, "Write a loop."), prompt(1, "Hi")], tmp_path / "d.jsonl", max_new_tokens=6,
                      batch_size=2, progress=False)
    meta = {"model": "tiny", "path": "reference path, fp32 weights, cpu", "batch_size": 2, "seconds_this_run": 1.0}
    path = ship(records, meta, loaded.tokenizer, tmp_path / "shipped", "tiny")
    shipped = read_records(path)
    assert [r["answer"] for r in shipped] == [loaded.tokenizer.decode(r["answer_ids"], skip_special_tokens=True)
                                              for r in records]
    assert all(r["answer"] for r in shipped)
    assert [t.tolist() for t in distilled_sequences(shipped, 8)] == [t.tolist() for t in distilled_sequences(records, 8)]
    shipped_meta = json.loads((tmp_path / "shipped" / "tiny.meta.json").read_text())
    assert shipped_meta["forward_path"] == meta["path"] and "seconds_this_run" not in shipped_meta
    assert shipped_meta["generation_seconds"] == round(sum(r["batch_seconds"] for r in records) / 2)


def test_conversations_pack_into_rows_in_order():
    records = [{"prompt_ids": [1, 2], "answer_ids": [3, 4, 5], "stop": "max_new_tokens"},
               {"prompt_ids": [6], "answer_ids": [7, 9], "stop": "eos"}]
    rows = distilled_sequences(records, seq_len=3, end_ids=(9,))
    assert [r.tolist() for r in rows] == [[1, 2, 3], [4, 5, 9], [6, 7, 9]]    # a cut answer gets an end of turn
    assert distilled_sequences(records, seq_len=20) == []


def test_held_out_conversations_stay_held_out_as_the_corpus_grows():
    records = [{"id": f"r{i}", "source": "sharegpt" if i % 2 else "stdlib"} for i in range(400)]
    train, held = heldout_split(records[:200], 0.1)
    assert {r["id"] for r in train} | {r["id"] for r in held} == {r["id"] for r in records[:200]}
    assert not {r["id"] for r in train} & {r["id"] for r in held} and 8 <= len(held) <= 32
    train2, held2 = heldout_split(records, 0.1)                     # twice the conversations
    assert {r["id"] for r in held} <= {r["id"] for r in held2} and {r["id"] for r in train} <= {r["id"] for r in train2}
    assert [r for r in train2 if r in train] == train                # the same relative order: prefixes are samples
    assert [r["id"] for r in train] != sorted(r["id"] for r in train)
    with pytest.raises(ValueError, match="fraction"):
        heldout_split(records, 1.0)


def test_a_feature_set_holds_out_the_conversations_its_meta_names(tiny_target, tmp_path):
    import torch

    from labkit.training.features import FeatureSet, extract_features
    seqs = [torch.arange(i, i + 8) for i in range(10)]
    meta = {"corpus": {"heldout_sequences": {"sharegpt": 2, "stdlib": 3}}}
    extract_features(tiny_target, seqs, tmp_path, shard_size=4, meta=meta, progress=False)
    fs = FeatureSet(tmp_path)
    assert fs.n_train == 5 and fs.heldout_rows() == {"sharegpt": slice(0, 2), "stdlib": slice(2, 5)}
    assert fs.split("heldout")[0][fs.heldout_rows()["stdlib"]][0].tolist() == list(range(7, 15))
    assert FeatureSet(tmp_path, n_heldout=1).heldout_rows() == {"all": slice(0, 1)}
    meta_path = tmp_path / "meta.json"                               # an extraction stopped before the held-out rows
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "n_sequences_planned": 12}))
    with pytest.raises(ValueError, match="finish the extraction"):
        FeatureSet(tmp_path)


def test_bad_settings_are_refused(tiny_target, tmp_path):
    loaded = LoadedModel(tiny_target, chatml_tokenizer(), "tiny", "native", eos_token_ids=(1,))
    with pytest.raises(ValueError, match="batch_size"):
        distill(loaded, [prompt(0, "x")], tmp_path / "d.jsonl", batch_size=0, progress=False)
    assert read_records(tmp_path / "nothing.jsonl") == []
