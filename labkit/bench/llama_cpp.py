"""llama.cpp as a peer: what a CPU user would pick instead, run on the same GGUF pair and prompts.

`make llama-cpp` builds `llama-completion` (plain decoding) and `llama-speculative-simple` (a
draft model or an EAGLE-3 head proposing γ tokens a step) from the llama.cpp source vendored in the
llama-cpp-python sdist into build/llama.cpp/bin (LABKIT_LLAMA_CPP names another folder). Each
question is one process on the preset's GGUF file itself (Q4_K_M: llama.cpp's own quantised
kernels, where labkit computes with the dequantised weights). The prompt is the same chat-
templated text labkit feeds; the timings are llama.cpp's own (prompt evaluation + decoding,
model loading excluded), so its tok/s compares with labkit's, which include the prefill too.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..files.shipped import CHECKOUT

PROGRAMS = ("llama-completion", "llama-speculative-simple")
BENCH = "llama-bench"


def bin_dir() -> Path:
    return Path(os.environ.get("LABKIT_LLAMA_CPP") or CHECKOUT / "build" / "llama.cpp" / "bin")


def available(programs: tuple[str, ...] = PROGRAMS) -> bool:
    """Whether the llama.cpp programs are built (the benchmark runs its methods only then)."""
    return all(os.access(bin_dir() / p, os.X_OK) for p in programs)


def check_available(programs: tuple[str, ...] = PROGRAMS) -> None:
    if not available(programs):
        raise ValueError(f"the llama.cpp methods need {' and '.join(programs)} in {bin_dir()}: run `make llama-cpp` "
                         "(about 20 minutes), or set LABKIT_LLAMA_CPP to a folder holding them")


def check_model(name: str) -> None:
    """llama.cpp reads a preset's GGUF file: any other model is an error."""
    from ..models.hub import PRESETS
    if name not in PRESETS:
        raise ValueError(f"the llama.cpp methods run the presets' GGUF files; {name!r} is not a preset "
                         f"({', '.join(PRESETS)})")


def gguf_file(name: str) -> Path:
    """The verified GGUF of preset `name` (llama.cpp reads the file labkit converted)."""
    from ..models.hub import fetch_weights
    check_model(name)
    return fetch_weights(name, progress=False)


@dataclass
class LlamaRun:
    text: str               # the new text
    n_new: int              # new tokens, as llama.cpp counted them
    seconds: float          # prompt evaluation + decoding, llama.cpp's clocks
    target_forwards: int
    drafted: int = 0
    accepted: int = 0
    prefill_seconds: float | None = None   # its prompt evaluation


def _run(program: str, args: list[str], prompt: str) -> tuple[str, str]:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write(prompt)
        f.flush()
        res = subprocess.run([str(bin_dir() / program), *args, "-f", f.name], capture_output=True, text=True,
                             stdin=subprocess.DEVNULL, errors="replace")
    if res.returncode != 0:
        raise RuntimeError(f"{program} exited with {res.returncode}:\n{res.stderr[-2000:]}")
    return res.stdout, res.stderr


def _number(pattern: str, log: str, program: str) -> float:
    m = re.search(pattern, log)
    if m is None:
        raise RuntimeError(f"{program}'s log has no line matching {pattern!r}; its output format changed:\n{log[-1500:]}")
    return float(m.group(1))


def completion(target: Path, prompt: str, n: int, threads: int) -> LlamaRun:
    """Plain greedy decoding of up to n tokens."""
    out, log = _run("llama-completion", ["-m", str(target), "-n", str(n), "-t", str(threads), "--temp", "0",
                                         "-no-cnv", "--no-display-prompt", "-c", "4096", "--simple-io"], prompt)
    prompt_ms = _number(r"prompt eval time =\s*([\d.]+) ms", log, "llama-completion")
    after_prompt = log.split("prompt eval time")[-1]                     # the decode line comes next
    eval_ms = _number(r"\beval time =\s*([\d.]+) ms /\s*\d+ runs", after_prompt, "llama-completion")
    runs = int(_number(r"\beval time =\s*[\d.]+ ms /\s*(\d+) runs", after_prompt, "llama-completion"))
    text = out.removesuffix("\n").removesuffix(" [end of text]")
    return LlamaRun(text, runs + 1, (prompt_ms + eval_ms) / 1e3, runs + 1, prefill_seconds=prompt_ms / 1e3)


SPEC_TYPES = ("draft-simple", "draft-eagle3")


def speculative(target: Path, draft: Path, prompt: str, n: int, gamma: int, threads: int,
                spec_type: str = "draft-simple") -> LlamaRun:
    """Greedy decoding with the draft proposing up to γ tokens a step: a draft model (llama.cpp's draft-simple)
    or an EAGLE-3 head reading the target's hidden states (draft-eagle3, a GGUF of export/llama_cpp.py)."""
    if spec_type not in SPEC_TYPES:
        raise ValueError(f"unknown llama.cpp draft type {spec_type!r}: choose from {', '.join(SPEC_TYPES)}")
    try:
        out, log = _run("llama-speculative-simple", [
            "-m", str(target), "-md", str(draft), "--spec-type", spec_type, "--spec-draft-n-max", str(gamma),
            "-n", str(n), "-t", str(threads), "-td", str(threads), "--temp", "0", "-c", "4096"], prompt)
    except RuntimeError as e:
        if "layer input tensor is null" in str(e):
            raise RuntimeError(f"{e}\nthis llama.cpp build does not hand the Qwen2 target's layer inputs to "
                               "draft-eagle3: rebuild it with `rm -rf build/llama.cpp && make llama-cpp`, which "
                               "adds that tap") from None
        raise
    prog = "llama-speculative-simple"
    enc = _number(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", log, prog)
    dec = _number(r"decoded\s+\d+ tokens in\s+([\d.]+) seconds", log, prog)
    n_new = int(_number(r"decoded\s+(\d+) tokens", log, prog))
    drafted, accepted = int(_number(r"n_drafted\s*=\s*(\d+)", log, prog)), int(_number(r"n_accept\s*=\s*(\d+)", log, prog))
    shown = out.removeprefix("\n\n")
    for head in (prompt, prompt.rstrip("\n")):           # it echoes the prompt, then the new text
        if shown.startswith(head):
            shown = shown[len(head):]
            break
    # each target forward commits its accepted draft tokens + one of its own: forwards = new - accepted
    return LlamaRun(shown.removesuffix("\n\n"), n_new, enc + dec, 1 + n_new - accepted, drafted, accepted, enc)


def cost_row(gguf: Path, tokens: tuple[int, ...], context: int, repeats: int, threads: int) -> dict:
    """llama.cpp's forward time for T tokens after `context` cached ones (llama-bench -p T -d context), as a
    row of the verify-cost table: the same question labkit's paths answer, on llama.cpp's own kernels."""
    import json
    check_available((BENCH,))
    res = subprocess.run([str(bin_dir() / BENCH), "-m", str(gguf), "-t", str(threads), "-p", ",".join(map(str, tokens)), "-n", "0",
                          "-d", str(context), "-r", str(repeats), "-o", "json"], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        raise RuntimeError(f"{BENCH} exited with {res.returncode}:\n{res.stderr[-2000:]}")
    by_t = {r["n_prompt"]: r for r in json.loads(res.stdout)}
    times = {str(t): min(by_t[t]["samples_ns"]) / 1e9 for t in tokens}             # the best, like labkit's
    return {"path": "llama.cpp", "precision": gguf.stem.rsplit("-", 1)[-1].upper(),            # Q4_K_M
            "times_s": times, "ratio": {str(t): times[str(t)] / times[str(tokens[0])] for t in tokens},
            "weight_bytes": by_t[tokens[0]]["model_size"], "compute_line_s": None,
            "program": f"{BENCH} -p T -n 0 -d {context} -r {repeats} -t {threads}"}
