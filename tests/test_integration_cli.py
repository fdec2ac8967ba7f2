"""The command line on the real pair, from fresh processes, as a script would call it.

A module of its own so that the fp32 pair the other integration tests hold is freed first:
each subprocess loads its own copy (about 10 GB in fp32), one at a time.
"""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration
PROMPT = "Write a Python function that checks whether a string is a palindrome."


def generate_json(*args: str) -> dict:
    cmd = [sys.executable, "-m", "labkit", "generate", "--dtype", "fp32", "--max-new-tokens", "24", "--json",
           "--prompt", PROMPT, *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)


def test_cli_json_speculative_equals_plain():
    plain = generate_json("--drafter", "none")
    spec = generate_json("--drafter", "draft", "--gamma", "4")
    assert spec["tokens"] == plain["tokens"] and len(plain["tokens"]) > 0
    assert spec["prompt_tokens"] == plain["prompt_tokens"] and spec["text"] == plain["text"]
    assert spec["stats"]["tokens_per_forward"] > 1.5 and plain["stats"]["tokens_per_forward"] == 1
    committed = [t for s in spec["steps"] for t in s["proposed"][: s["n_accepted"]] + [s["next_token"]]]
    assert committed[: len(spec["tokens"])] == spec["tokens"]
