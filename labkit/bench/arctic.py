"""Arctic Inference's suffix decoding (Snowflake, the SuffixDecoding authors' engine code) as a peer.

`make arctic` builds the suffix tree of arctic-inference 0.3.0 (its C++ extension and its
`SuffixDecodingCache`) into build/arctic/pkg (LABKIT_ARCTIC names another folder). Two uses:

    ArcticSuffixDrafter    its cache behind labkit's drafter interface (drafters/arctic_suffix.py): the bench
                           method `arctic-suffix` verifies its trees with labkit's tree decoder, beside `suffix`
    replay(...)            both drafters at every step of recorded greedy outputs (the same contexts): how
                           often the two trees are the same, and the tokens per forward each would commit

The settings are labkit's suffix drafter's, in Arctic's words: its tree of at most `budget` nodes and
spec_factor x match length (`max_spec_factor`), nodes of path probability >= min_prob (`min_token_prob`),
suffixes of up to max_pattern + max_depth tokens indexed (`max_tree_depth`). Where the two differ by
design: Arctic tries every match length and keeps the best-scoring tree, labkit the longest match; Arctic
divides a child's count by its parent's (occurrences that end there included), labkit by its siblings'.

    python -m labkit.bench.arctic --run data/bench/code_edit --out data/bench/arctic_suffix
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..core.sampling import SamplingConfig
from ..drafters.arctic_suffix import VERSION, ArcticSuffixDrafter, available, check_available
from ..files.shipped import CHECKOUT

__all__ = ["ArcticSuffixDrafter", "available", "check_available", "paths", "proposal_paths", "accepted", "replay",
           "recorded"]


def paths(tokens: list[int], parents: list[int]) -> frozenset[tuple[int, ...]]:
    """A tree as the set of its root-to-node token paths (the same tree whatever order its nodes come in)."""
    out, path_of = set(), []
    for tok, par in zip(tokens, parents):
        p = (path_of[par] if par >= 0 else ()) + (tok,)
        path_of.append(p)
        out.add(p)
    return frozenset(out)


def proposal_paths(prop) -> frozenset[tuple[int, ...]]:
    """A drafter's Proposal (a chain or a tree) as its set of root-to-node token paths."""
    return paths(prop.tokens.tolist(), prop.as_tree().parents.tolist()) if prop.k else frozenset()


def accepted(tree: frozenset[tuple[int, ...]], truth: list[int]) -> int:
    """Greedy acceptance of a tree against the tokens the target commits: its longest path that they begin with."""
    n = 0
    while n < len(truth) and tuple(truth[:n + 1]) in tree:
        n += 1
    return n


def replay(sequences: list[tuple[list[int], list[int]]], budget: int) -> dict:
    """Both drafters along each (prompt, greedy output): at every step the same context, both trees compared,
    then the step advances by what labkit's tree accepted + 1 (as decoding does; the two drafters' own
    tokens per forward are counted step by step in their own replays)."""
    from ..drafters.suffix import SuffixDrafter
    greedy = SamplingConfig()
    per_question, same_total, steps_total = [], 0, 0
    forwards = {"labkit": 0, "arctic": 0}
    new_tokens = 0
    for prompt, output in sequences:
        labkit, arctic = SuffixDrafter(), ArcticSuffixDrafter()
        row = {"tokens": len(output)}
        for name, drafter in (("labkit", labkit), ("arctic", arctic)):   # each drafter's own decoding
            drafter.start(torch.tensor(prompt))
            i, fwd = 0, 0
            while i < len(output):
                tree = proposal_paths(drafter.propose(torch.tensor(prompt + output[:i]), budget, greedy))
                i += accepted(tree, output[i:]) + 1
                fwd += 1
            row[f"{name}_forwards"] = fwd
            forwards[name] += fwd
        labkit.start(torch.tensor(prompt))
        arctic.start(torch.tensor(prompt))
        i, same, steps = 0, 0, 0
        while i < len(output):                                             # the same contexts for both
            context = torch.tensor(prompt + output[:i])
            ta = proposal_paths(labkit.propose(context, budget, greedy))
            same += ta == proposal_paths(arctic.propose(context, budget, greedy))
            steps += 1
            i += accepted(ta, output[i:]) + 1
        row.update(steps=steps, same_tree=same)
        per_question.append(row)
        same_total, steps_total, new_tokens = same_total + same, steps_total + steps, new_tokens + len(output)
    return {"questions": len(sequences), "new_tokens": new_tokens, "budget": budget,
            "steps_compared": steps_total, "same_tree": same_total / steps_total,
            "tokens_per_forward": {k: new_tokens / v for k, v in forwards.items()}, "per_question": per_question}


def recorded(run: Path, method: str = "ar") -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy output ids) of each question of a bench folder's `method` records, the prompt
    encoded from the run's question file as the bench encoded it."""
    from transformers import AutoTokenizer

    from ..models.hub import resolve_model
    from ..models.loading import encode_prompt
    from .questions import read_questions
    from .records import read_results
    lines = read_results(run / "results.jsonl")
    meta = next((r["meta"] for r in lines if "meta" in r), None)
    if meta is None:
        raise ValueError(f"{run}/results.jsonl holds no benchmark run: give a folder `python -m labkit bench` wrote")
    tok = AutoTokenizer.from_pretrained(resolve_model(meta["target"]))
    questions = {q.question_id: q for q in read_questions(CHECKOUT / meta["questions"])}
    out, seen = [], set()
    for r in lines:
        if r.get("method") != method or r["question_id"] in seen:
            continue
        seen.add(r["question_id"])
        q = questions[r["question_id"]]
        ids = encode_prompt(tok, q.messages if q.earlier else q.prompt, meta["chat_template"]).tolist()
        if len(ids) != r["prompt_tokens"]:
            raise ValueError(f"{run}: question {q.question_id}'s prompt is {len(ids)} tokens here, "
                             f"{r['prompt_tokens']} in the run: the question file or the template changed")
        out.append((ids, list(r["tokens"])))
    if not out:
        raise ValueError(f"{run}/results.jsonl has no {method!r} records: run the bench with that method first")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m labkit.bench.arctic", description=__doc__.split("\n")[0])
    ap.add_argument("--run", required=True, help="a bench folder whose `ar` records hold greedy outputs")
    ap.add_argument("--budget", type=int, default=24, help="tree nodes a step (the bench's suffix budget)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from ..files.textfile import writable_dir
    out = writable_dir(a.out, "--out")
    check_available()
    result = replay(recorded(Path(a.run)), a.budget)
    result["run"], result["peer"] = str(a.run), f"arctic-inference {VERSION}, SuffixDecodingCache, tree mode"
    (out / "arctic_suffix.json").write_text(json.dumps(result, indent=1) + "\n")
    tpf = result["tokens_per_forward"]
    md = [f"# Arctic Inference's suffix cache against labkit's suffix drafter, on {a.run}'s greedy outputs", "",
          f"{result['questions']} questions, {result['new_tokens']:,} new tokens, trees of up to {a.budget} nodes; "
          f"peer: {result['peer']}.", "",
          "| | labkit `suffix` | Arctic `SuffixDecodingCache` |", "|---|---|---|",
          f"| tokens per forward, replayed | {tpf['labkit']:.3f} | {tpf['arctic']:.3f} |",
          f"| the same tree, at {result['steps_compared']:,} steps of the same context | "
          f"{result['same_tree']:.1%} | |", ""]
    (out / "arctic_suffix.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
