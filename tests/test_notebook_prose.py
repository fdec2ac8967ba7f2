"""No measurement is typed into the notebooks' prose.

A number a reader sees in a Markdown cell was either typed by hand, and then it drifts from the
outputs beside it the next time the notebook runs, or it is not a measurement at all. So every
digit in a Markdown cell must be one of:
- mathematics ($...$) or code (`...`), a link's address;
- the text's own structure: list and section numbers, a notebook's number (02), a count below ten
  ("head 3", "γ = 4");
- part of a name (EAGLE-3, bf16, H100, Qwen2.5-Coder-1.5B, a 0.5B model) or a year of a citation;
- an entry of ALLOWED below: a constant of the lab or a paper's figure with its source, each with
  the reason it cannot drift.
A measured number belongs in a code cell's output, where the sentence is rendered from the value.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

# notebook stem prefix -> {phrase as typed: why the number in it is not a measurement}
ALLOWED: dict[str, dict[str, str]] = {
    "00": {"write 64 tokens": "an example count, the same in the sentence after it",
           "weights 64 times": "the same example count"},
    "01": {"2 KV heads for 12 query heads": "the target's architecture (its config)",
           "cache for 4096 tokens": "an exercise's premise",
           "batch of 16 sequences": "an exercise's premise"},
    "02": {"γ from 1 to 10": "the stepper slider's range, an exercise"},
    "03": {"20,000 times": "the number of trials, a constant of the check (N_TRIALS in the code cell)",
           "20,000 trials": "the same constant",
           "top-k = 50 both distributions\nlive on at most 100 tokens": "the check's top-k, and the union of two "
                                                                        "top-k sets",
           "top-50 tokens": "an exercise's premise"},
    "04": {"64 cached ones": "the verify-curve measurement's context length (measure_verify_curve)",
           "from 1 to 33": "the verify-curve measurement's token counts (CURVE_TOKENS)",
           "0.1 and α to 0.8": "an exercise's settings"},
    "05": {"(0.1)": "SuffixDrafter's default min_score, named beside it",
           "to 2, 4 and 16": "an exercise's settings"},
    "06": {"the 10 nodes": "the example tree's size, built in the code cell above",
           "blocks 1, 13 and 24\n  of 28": "the EAGLE-3 head's tapped blocks (its config) and the target's depth",
           "2.0, 2.5\n  and 3.0": "the acceptance targets of the table's columns (its code)",
           "530,000\n  entries": "the size of EAGLE-3's published training data, ShareGPT and UltraChat-200K "
                                "(Li et al. 2025)",
           "32-token forward": "an example width",
           "1-token one": "an example width",
           "21 questions": "the size of the shipped question set, data/questions/labkit_bench.jsonl",
           "64 new tokens": "the benchmark's answer length",
           "32-node trees": "the benchmark's fixed tree size",
           "temperature 0.7": "an exercise's setting"},
    "07": {"vocabulary 256": "a byte-level model's vocabulary, by definition",
           "4-block trunk": "the shipped models' architecture (their config)",
           "on 32\nheld-out windows": "the accuracy measurement's sample size (its code)",
           "heads 2-4": "head numbers",
           "2-4 M parameter": "the shipped models' size class",
           "6 held-out prompts": "the measurement's prompt count (its code)",
           "64 new bytes": "the measurement's answer length (its code)",
           "tree of 16 nodes": "Medusa's static tree size (its choices)",
           "1.5 B\nmodel": "the target's size class",
           "12 held-out prompts of 128 bytes": "the committed measurement's set (data/mtp/results.md)",
           "12 held-out prompts\nof 128 bytes": "the same set",
           "10-block": "a shipped variant's architecture",
           "4 to 32 nodes": "the tree sizes the ablations tried",
           "4 and to 32 nodes": "an exercise's settings"},
    "08": {"(1..64)": "the verify curve's token counts", "256 cached tokens": "the verify curve's context length",
           "k=64": "the widest forward of the curve",
           "50-60%": "gpt-fast's own reported bandwidth share, named as its source",
           "8-64 nodes": "the compiled tree's padded widths (its buckets)"},
    "09": {"151,936-token": "the target's vocabulary (its tokenizer)",
           "(49,152 tokens)": "the draft's vocabulary (its tokenizer)",
           "(151,936)": "the target's vocabulary (its tokenizer)",
           "a block of 10 tokens": "the Jacobi demo's block length (its code)",
           "21 questions": "the size of the shipped question set",
           "7B-70B": "the published models' sizes",
           "to reach 1.2x": "an exercise's target",
           "of 1 and of 32": "an exercise's settings",
           "W=2, 5 and 10": "an exercise's settings"},
}

MATH = re.compile(r"\$\$.*?\$\$|\$[^$]+\$", re.S)           # inline maths may wrap a line
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
LINK = re.compile(r"\]\([^)]*\)|<[^>]+>")
NUMBERING = re.compile(r"^\s*(?:#+\s*)?\d+\.\s", re.M)                 # list items, numbered sections
WORD = re.compile(r"[\w.,\-−+%()'’]*\d[\w.,\-−+%()'’]*")
YEAR = re.compile(r"\b(?:19[89]\d|20[0-2]\d)[a-z]?\b")
NOTEBOOK = re.compile(r"\b0\d\b")
SIZE = re.compile(r"\d+(?:\.\d+)?[BMK]")                                 # a model's size class: 1.5B, 135M
NAME = re.compile(r"(?=.*[A-Za-z])[A-Za-z][\w.\-]*\d[\w.\-]*|\d+[A-Za-z][\w.\-]*")
MEASURE = re.compile(r"\d(?:\.\d+)?\s*(?:x|%)(?!\w)")                    # a speedup or a share is never a name
SMALL_COUNT = re.compile(r"[+−-]?\d")


def typed_numbers(text: str, allowed: dict[str, str] = {}) -> list[str]:
    """The numbers in Markdown `text` that none of the rules above allows."""
    for phrase in allowed:
        text = text.replace(phrase, " ")
    text = NUMBERING.sub(" ", LINK.sub(" ", CODE.sub(" ", MATH.sub(" ", text))))
    found = []
    for match in WORD.finditer(text):
        word = re.sub(r"['’]s$", "", match.group().strip(".,()'’:;?"))
        if MEASURE.search(word):
            found.append(word)
            continue
        rest = NOTEBOOK.sub("", YEAR.sub("", word))
        if not re.search(r"\d", rest) or SMALL_COUNT.fullmatch(rest) or SIZE.fullmatch(word) or NAME.fullmatch(word):
            continue
        found.append(word)
    return found


def test_the_rules_catch_typed_measurements():
    assert typed_numbers("the heuristic policy ran at 1.54x, faster than γ = 4") == ["1.54x"]
    assert typed_numbers("a step took 73 ms") == ["73"]
    assert typed_numbers("the head is about 15% of the weights") == ["15%"]
    assert "0.78" in typed_numbers("t(8)/t(1) is 0.78 here")
    assert typed_numbers("$t(8)/t(1) = 0.78$, `run(64)`, [x](https://a/b2024)") == []
    assert typed_numbers("1. EAGLE-3 on bf16, Qwen2.5-Coder-1.5B (Li et al. 2025), a 0.5B draft; head 3 (02)") == []
    assert typed_numbers("the 21 questions", {"21 questions": "the set's size"}) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_measurement_typed_into_prose(path):
    nb = json.loads(path.read_text())
    allowed = ALLOWED.get(path.stem[:2], {})
    found = {i: typed_numbers("".join(cell["source"]), allowed)
             for i, cell in enumerate(nb["cells"]) if cell["cell_type"] == "markdown"}
    found = {i: words for i, words in found.items() if words}
    assert not found, (f"numbers typed into Markdown cells (cell: numbers): {found}. Render a measured number "
                       "from its value in a code cell's Markdown output; a constant goes into ALLOWED with why "
                       "it cannot drift")


def test_every_allowed_phrase_is_still_there():
    for path in NOTEBOOKS:
        text = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                         if c["cell_type"] == "markdown")
        stale = [p for p in ALLOWED.get(path.stem[:2], {}) if p not in text]
        assert not stale, f"{path.name}: ALLOWED phrases no longer in its Markdown: {stale}"


def test_rendered_comparisons_follow_their_numbers():
    from labkit.viz.prose import compare, versus, words
    assert words([]) == "" and words(["a"]) == "a" and words(["a", "b", "c"]) == "a, b and c"
    assert compare(1.54, 1.54) == "level with" and compare(1.62, 1.54) == "faster than"
    assert compare(1.50, 1.54) == "level with" and compare(1.40, 1.54) == "slower than"
    assert compare(1.50, 1.54, noise=0.0) == "slower than"
    fixed = {"γ = 1": 1.21, "γ = 4": 1.54, "γ = 8": 1.80}
    assert versus(1.54, fixed) == ("faster than γ = 1, level with γ = 4 (within 5%, timing noise) and "
                                   "slower than γ = 8")
    assert versus(2.0, fixed, all_name="every fixed γ") == "faster than every fixed γ"
    with pytest.raises(ValueError, match="noise"):
        compare(1.0, 1.0, noise=-0.1)
    with pytest.raises(ValueError, match="at least one"):
        versus(1.0, {})
