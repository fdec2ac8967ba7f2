"""labkit's EAGLE-3 heads checked by speculators (vLLM's EAGLE-3 trainer and format), not by labkit.

    python -m labkit.export.peers --python PEER_PYTHON [--head eagle3-qwen2.5-coder-1.5b] --out data/bench/peers

PEER_PYTHON is an interpreter with speculators installed (`make peers` builds one in .peers-venv: speculators
caps transformers below labkit's, so it lives apart). Three checks on the same target features:

1. the head exported as speculators' format, loaded by speculators' `Eagle3DraftModel.from_pretrained` and run
   through its own training-time-test forward: its LM-head logits of every step against labkit's
   `unrolled_logits` (fp32), and its greedy draft tokens against labkit's;
2. the head exported in the SpecForge (SGLang) layout, converted by speculators' own converter, the same;
3. a head made by speculators (its own init, weights drawn around it, written by its `save_pretrained`),
   imported by labkit's `load_eagle3`: labkit's logits of it against speculators'.

Step k at root t reads the true token x_{t+1+k} in both (speculators' teacher forcing); rows past the end, where
speculators pads with token 0 and labkit repeats the last token, are not compared.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from ..models.adapters import layer_taps
from ..models.eagle3_formats import aux_layer_ids
from ..models.eagle_heads import load_eagle3
from ..training.eagle_loss import unrolled_logits
from .eagle3 import export_eagle3

SIDE = Path(__file__).with_name("speculators_side.py")


def peer_run(python: str, mode: str, head_dir: Path, inputs: Path, out: Path, *extra: str) -> dict:
    """Run speculators_side.py in the peer interpreter; its outputs (logits, draft ids, d2t, versions)."""
    cmd = [python, str(SIDE), mode, str(head_dir), str(inputs), str(out), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                                                                   "PATH": "/usr/bin:/bin"})
    if r.returncode:
        raise RuntimeError(f"speculators failed ({' '.join(cmd)}):\n{r.stderr[-3000:]}")
    return torch.load(out, weights_only=True)


@torch.no_grad()
def labkit_side(head, target, tokens: torch.Tensor, taps: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """labkit's draft logits of every step (steps x (n, Vd)) for tokens (1, T) and their fused taps (1, T, 3D)."""
    return [x[0] for x in unrolled_logits(head, target.embed_tokens, head.lm_head.weight, tokens, taps, steps)]


def compare(ours: list[torch.Tensor], theirs: dict, draft_vocab: torch.Tensor) -> list[dict]:
    """Per step: the largest logit difference (valid rows), the logits' scale, and the share of equal top-1 ids."""
    n = ours[0].shape[0]
    their_d2t = theirs["d2t"]
    rows = []
    for k, (a, b) in enumerate(zip(ours, theirs["logits"])):
        valid = n - k                                            # roots whose step-k token exists
        a, b = a[:valid].float(), b[:valid].float()
        ids_ours = draft_vocab[a.argmax(-1)]
        ids_theirs = theirs["draft_ids"][k][:valid]
        ids_theirs = ids_theirs + their_d2t[ids_theirs] if their_d2t is not None else ids_theirs
        rows.append({"step": k, "rows": valid, "max_abs_diff": float((a - b).abs().max()),
                     "logit_scale": float(a.abs().max()), "top1_equal": float((ids_ours == ids_theirs).float().mean())})
    return rows


def check(head_dir: Path, target_dir: Path, target, python: str, token_rows: list[torch.Tensor], steps: int,
          work: Path, seed: int = 0) -> dict:
    """The three checks over every token row (1-D tensors); a dict of results per check and row."""
    head, draft_vocab, config = load_eagle3(head_dir, target)
    layers = tuple(config["layers"])
    spec = export_eagle3(head_dir, target_dir, work / "speculators", "speculators", steps, dtype=torch.float32)
    forge = export_eagle3(head_dir, target_dir, work / "specforge", "specforge", steps, dtype=torch.float32)
    D = target.args.dim
    results = {"speculators": [], "specforge": [], "written_by_speculators": []}
    versions = None
    for i, tokens in enumerate(token_rows):
        tokens = tokens[None].long()                                                    # (1, T)
        taps = layer_taps(target, tokens, target.new_cache(), layers)[..., :3 * D].float()   # (1, T, 3D)
        inputs = work / f"inputs_{i}.pt"
        torch.save({"hidden_states": taps[:, :-1].contiguous(), "input_ids": tokens[:, 1:].contiguous(),
                    "steps": steps}, inputs)
        ours = labkit_side(head, target, tokens, taps, steps)
        theirs = peer_run(python, "run", spec, inputs, work / f"spec_{i}.pt")
        results["speculators"].append(compare(ours, theirs, draft_vocab))
        theirs = peer_run(python, "run", forge, inputs, work / f"forge_{i}.pt", "--verifier", str(target_dir))
        results["specforge"].append(compare(ours, theirs, draft_vocab))
        theirs = peer_run(python, "write", spec, inputs, work / f"written_{i}.pt", str(seed))
        written, written_vocab, _ = load_eagle3(Path(theirs["written"]), target)
        results["written_by_speculators"].append(compare(labkit_side(written, target, tokens, taps, steps),
                                                         theirs, written_vocab))
        versions = theirs["versions"]
    return {"head": str(head_dir.name), "layers": list(layers), "aux_layer_ids": aux_layer_ids(layers),
            "draft_vocab_size": int(draft_vocab.numel()), "steps": steps,
            "rows": [int(t.numel()) for t in token_rows], "peer_versions": versions, "results": results}


def summary(results: dict) -> dict:
    """Per check: the largest logit difference over all rows and steps, relative to the logits' scale, and the
    share of equal greedy draft tokens (all steps)."""
    out = {}
    for name, per_row in results["results"].items():
        steps = [s for row in per_row for s in row]
        n = sum(s["rows"] for s in steps)
        out[name] = {"max_abs_diff": max(s["max_abs_diff"] for s in steps),
                     "max_rel_diff": max(s["max_abs_diff"] / s["logit_scale"] for s in steps),
                     "top1_equal": sum(s["top1_equal"] * s["rows"] for s in steps) / n, "compared": n}
    return out


def markdown(record: dict) -> str:
    s = record["summary"]
    words = {"speculators": "labkit's export, loaded by speculators' `Eagle3DraftModel.from_pretrained`",
             "specforge": "labkit's SpecForge export, converted by speculators' converter",
             "written_by_speculators": "a head written by speculators' `save_pretrained`, imported by labkit"}
    lines = [f"# EAGLE-3 peer check: {record['head']} against speculators {record['peer_versions']['speculators']}",
             "", f"{record['machine']}; load average {record['load_before']} before. Target "
             f"{record['target']} in fp32, blocks {record['layers']} (the engines' aux ids {record['aux_layer_ids']}), "
             f"{record['draft_vocab_size']:,} draft tokens, {record['steps']} training-time-test steps over "
             f"{len(record['rows'])} token rows of {', '.join(map(str, record['rows']))} tokens. Peer: speculators "
             f"{record['peer_versions']['speculators']}, transformers {record['peer_versions']['transformers']}, "
             f"torch {record['peer_versions']['torch']}.", "",
             "| check | draft logits compared | largest difference | relative to the largest logit | "
             "greedy draft tokens equal |", "|---|---|---|---|---|"]
    for name, r in s.items():
        lines.append(f"| {words[name]} | {r['compared']:,} | {r['max_abs_diff']:.2e} | {r['max_rel_diff']:.1e} | "
                     f"{r['top1_equal']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from ..files.shipped import shipped
    from ..files.textfile import writable_dir
    from ..models.hub import resolve_model
    from ..models.loading import encode_prompt, load_model
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", required=True, help="an interpreter with speculators installed (make peers)")
    ap.add_argument("--head", default="eagle3-qwen2.5-coder-1.5b", help="a head directory or a shipped head's name")
    ap.add_argument("--questions", default=str(shipped("questions") / "code_edit.jsonl"))
    ap.add_argument("--n", type=int, default=4, help="questions whose prompts are the token rows")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="data/bench/peers")
    a = ap.parse_args(argv)
    head = Path(a.head) if Path(a.head).is_dir() else shipped("heads") / a.head
    out = writable_dir(a.out, "--out")
    base = json.loads((head / "config.json").read_text())["base_model"]
    target_dir = Path(resolve_model(base))
    lm = load_model(str(target_dir), dtype="fp32", backend="reference")
    questions = [json.loads(line) for line in Path(a.questions).read_text().splitlines() if line.strip()][: a.n]
    rows = [encode_prompt(lm.tokenizer, q["turns"][0], chat_template=True) for q in questions]
    load = Path("/proc/loadavg").read_text().split()[0]
    t0 = time.time()
    with tempfile.TemporaryDirectory() as work:
        record = check(head, target_dir, lm.model, a.python, rows, a.steps, Path(work))
    from ..models.calibrate import run_facts
    facts = run_facts(lm.model)
    machine = (f"{facts['cpu']} ({facts['isa']}), {facts['threads']} threads, torch {facts['torch']}, target "
               f"forward path {facts['target']}")
    record.update(target=base, machine=machine, load_before=load, seconds=round(time.time() - t0, 1),
                  python=platform.python_version())
    record["summary"] = summary(record)
    (out / "speculators_eagle3.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "speculators_eagle3.md").write_text(markdown(record))
    print(markdown(record))


if __name__ == "__main__":
    main()
