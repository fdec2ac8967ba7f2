"""The command line: JSON output scripts can rely on, and clear errors (no crash trace) for user mistakes."""
import json

import pytest
from conftest import save_tiny_checkpoint

from labkit.cli import main


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    target = tmp_path_factory.mktemp("target")
    save_tiny_checkpoint(target, "qwen2", seed=0)
    other_vocab = tmp_path_factory.mktemp("other")
    save_tiny_checkpoint(other_vocab, "qwen2", vocab_size=100, seed=1)
    return str(target), str(other_vocab)


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def generate(capsys, target, *extra):
    return run(capsys, "generate", "--target", target, "--draft", target, "--dtype", "fp32", "--no-chat-template",
               "--prompt", "def add(a, b):", *extra)


@pytest.mark.parametrize("drafter", ["draft", "lookup"])
def test_json_tokens_equal_plain_decoding(ckpts, capsys, drafter):
    code, out, _ = generate(capsys, ckpts[0], "--drafter", "none", "--json", "--max-new-tokens", "20")
    assert code == 0
    plain = json.loads(out)
    code, out, _ = generate(capsys, ckpts[0], "--drafter", drafter, "--gamma", "3", "--json", "--max-new-tokens", "20")
    spec = json.loads(out)
    assert code == 0 and spec["tokens"] == plain["tokens"] and len(spec["tokens"]) == 20
    assert spec["stats"]["new_tokens"] == 20 and spec["stats"]["tokens_per_forward"] >= 1
    assert set(spec) >= {"text", "tokens", "stats", "steps"}


def test_plain_text_output_when_not_a_terminal(ckpts, capsys):
    code, out, err = generate(capsys, ckpts[0], "--max-new-tokens", "8")
    assert code == 0 and "\033[" not in out and "tokens/forward" in err


@pytest.mark.parametrize("extra, message", [
    (["--gamma", "0"], "gamma"),
    (["--top-k", "0", "--temperature", "1"], "top_k"),
    (["--temperature", "-1"], "temperature"),
    (["--max-new-tokens", "0"], "max-new-tokens"),
    (["--max-seq-len", "4"], "context"),
])
def test_bad_numbers_get_clear_errors(ckpts, capsys, extra, message):
    code, out, err = generate(capsys, ckpts[0], *extra)
    assert code == 2 and message in err and "Traceback" not in err


def test_empty_prompt(ckpts, capsys):
    code, _, err = run(capsys, "generate", "--target", ckpts[0], "--prompt", "   ", "--drafter", "lookup")
    assert code == 2 and "prompt is empty" in err


def test_missing_model_directory(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "--target", str(tmp_path / "nope"), "--prompt", "hi", "--drafter", "none")
    assert code == 2 and "does not exist" in err


def test_draft_with_another_tokenizer(ckpts, capsys):
    code, _, err = run(capsys, "generate", "--target", ckpts[0], "--draft", ckpts[1], "--prompt", "x = 1",
                       "--no-chat-template", "--dtype", "fp32")
    assert code == 2 and "different tokenizer" in err and "lookup" in err


def test_corrupted_weights(tmp_path, capsys):
    save_tiny_checkpoint(tmp_path, "qwen2")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])   # a download cut in half
    code, _, err = run(capsys, "generate", "--target", str(tmp_path), "--prompt", "x", "--drafter", "none",
                       "--no-chat-template")
    assert code == 2 and "corrupted" in err and "Traceback" not in err


def test_json_records_where_it_ran(ckpts, capsys):
    code, out, err = generate(capsys, ckpts[0], "--drafter", "draft", "--backend", "reference", "--draft-precision",
                              "int8", "--json", "--max-new-tokens", "5")
    ran_on = json.loads(out)["ran_on"]
    assert code == 0
    assert ran_on["target_path"] == {"path": "reference", "precision": "fp32", "device": "cpu"}
    assert ran_on["draft_path"]["precision"] == "int8" and ran_on["cpu"] and ran_on["threads"] >= 1
    code, _, err = generate(capsys, ckpts[0], "--drafter", "none", "--backend", "reference", "--max-new-tokens", "3")
    assert code == 0 and "[ran on]" in err and "reference path, fp32 weights" in err


@pytest.mark.parametrize("extra,message", [(("--backend", "turbo"), "invalid choice"),
                                           (("--draft-precision", "int3"), "invalid choice")])
def test_bad_backend_and_draft_precision(ckpts, capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        generate(capsys, ckpts[0], *extra)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_verify_cost_writes_table_json_and_plot(ckpts, capsys, tmp_path):
    code, out, _ = run(capsys, "verify-cost", "--model", ckpts[0], "--paths", "reference,packed", "--precisions",
                       "fp32,int4", "--tokens", "1,4", "--repeats", "1", "--context", "8", "--out", str(tmp_path))
    assert code == 0 and "| reference | fp32 |" in out and "| packed | int4 |" in out
    written = sorted(p.suffix for p in tmp_path.glob("verify_cost_*"))
    assert written == [".json", ".md", ".png"]
    result = json.loads(next(tmp_path.glob("verify_cost_*.json")).read_text())
    assert {r["path"] for r in result["rows"]} == {"reference", "packed"}
    measured = [r for r in result["rows"] if "times_s" in r]
    assert measured and all(r["ratio"]["1"] == 1.0 and r["times_s"]["4"] > 0 for r in measured)
    # each row loaded in a process of its own; the integer kernels get no compute line, fp32 does
    assert all((r["compute_line_s"] is None) == (r["precision"] == "int4") for r in measured)
    code, _, err = run(capsys, "verify-cost", "--model", ckpts[0], "--precisions", "fp8", "--out", str(tmp_path))
    assert code == 2 and "--precisions takes" in err


@pytest.mark.parametrize("method", ["suffix", "lookahead", "draft-cost-aware", "lookup"])
def test_every_bench_method_runs_from_generate_and_equals_plain_decoding(ckpts, capsys, method):
    code, out, _ = generate(capsys, ckpts[0], "--drafter", "none", "--json", "--max-new-tokens", "16")
    plain = json.loads(out)
    code, out, err = generate(capsys, ckpts[0], "--method", method, "--json", "--max-new-tokens", "16")
    got = json.loads(out)
    assert code == 0, err
    assert got["method"] == method and got["tokens"] == plain["tokens"] and got["steps"]
    assert got["stats"]["method"].split("/")[0] in ("speculative", "tree")


def test_methods_lists_the_one_table_and_method_errors_say_what_to_do(ckpts, capsys):
    code, out, _ = run(capsys, "methods")
    names = [line.split()[0] for line in out.splitlines()]
    assert code == 0 and {"suffix", "lookahead", "medusa", "eagle3-tree", "llama-cpp"} <= set(names)
    assert {"gated", "whole", "all-ids", "rereads"} <= set(names[names.index("variants:"):])
    code, _, err = generate(capsys, ckpts[0], "--method", "no-such")
    assert code == 2 and "unknown methods" in err and "suffix" in err
    code, _, err = generate(capsys, ckpts[0], "--method", "suffix", "--temperature", "1")
    assert code == 2 and "--temperature 0" in err


def test_training_runs_from_the_one_command_line(capsys):
    with pytest.raises(SystemExit) as done:
        main(["train", "eagle", "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "python -m labkit train eagle" in out and "--kind" in out
    with pytest.raises(SystemExit) as done:
        main(["train", "nothing"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "invalid choice" in err and "medusa" in err


def test_measurements_run_from_the_one_command_line(capsys, monkeypatch):
    assert main(["measure", "--list"]) == 0
    listed = capsys.readouterr().out
    assert "roofline" in listed and "Time per target forward" in listed and "layer_skip_search" in listed
    with pytest.raises(SystemExit) as done:
        main(["measure", "roofline", "--help"])
    assert done.value.code == 0 and "--max-tokens" in capsys.readouterr().out
    assert main(["measure", "nothing"]) == 2 and "measure --list" in capsys.readouterr().err
    import labkit.files.shipped as shipped
    monkeypatch.setattr(shipped, "CHECKOUT", shipped.CHECKOUT / "not-a-checkout")
    assert main(["measure", "--list"]) == 2 and "clone the repository" in capsys.readouterr().err


def test_generate_names_the_speed_choices_it_made_and_the_textbook_draft_gives_the_same_tokens(ckpts, capsys):
    code, out, err = generate(capsys, ckpts[0], "--drafter", "draft", "--draft-window", "8", "--max-new-tokens", "12")
    assert code == 0 and "[speed choices]" in err and "the last 8 tokens" in err and "--draft-window all" in err
    code, textbook, err = generate(capsys, ckpts[0], "--drafter", "draft", "--draft-window", "all", "--draft-vocab",
                                   "all", "--max-new-tokens", "12")
    assert code == 0 and "[speed choices]" not in err and textbook == out
