"""Where a compiled tree step's time goes: the host's time in each part of the step, the device's kernels in each
part (torch.profiler), and each drafter's cost alone, for the replayed Medusa and EAGLE-3 trees of gpu_check.py.

On a GPU a step is as fast as the slower of two timelines: the host's (Python, launches, waits for the device)
and the device's (kernels, graph replays). A part whose host time is far above its device time is host-bound,
and the device idles through it unless work queued before it is still running.

    PYTHONPATH=. python3 scripts/profile_tree_step.py               # a CUDA GPU: the 1.5B shape, random weights
    PYTHONPATH=. python3 scripts/profile_tree_step.py --smoke       # tiny shapes on a CPU: the script's code path

Writes NAME.md and NAME.json (default tree_step_profile) to --out, and a copy to $OUT when that is set.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_check import MAX_TREE, PAIRS, REPLAYS, SMOKE_ARGS, build, scrub, sharpen, tree_drafter  # noqa: E402

from labkit.bench.runner import load_recorded_steps  # noqa: E402
from labkit.decoding import compiled_tree  # noqa: E402
from labkit.decoding.compiled_tree import CompiledTreeDecoder  # noqa: E402
from labkit.decoding.static import StaticDecoder  # noqa: E402
from labkit.drafters.base import Proposal  # noqa: E402
from labkit.drafters.replay import CostOnly, PacedDrafter  # noqa: E402
from labkit.models.backends import ATTENTIONS, use_attention  # noqa: E402


class Parts:
    """Host seconds spent in named parts of each step (each part also a profiler range)."""

    def __init__(self):
        self.seconds, self.patched = defaultdict(float), []

    @contextmanager
    def part(self, name: str):
        t0 = time.perf_counter()
        with torch.profiler.record_function(f"## {name}"):
            yield
        self.seconds[name] += time.perf_counter() - t0

    def wrap(self, owner, attr: str, name: str) -> None:
        """Time owner.attr (an object's method, a class's, or a module's function) as the part `name` until
        `restore`."""
        inner = getattr(owner, attr)

        def timed(*args, **kwargs):
            with self.part(name):
                return inner(*args, **kwargs)
        self.patched.append((owner, attr, vars(owner).get(attr), attr in vars(owner)))
        setattr(owner, attr, timed)

    def restore(self) -> None:
        """Put back what `wrap` replaced: an object's own attribute, or none (its class's method shows again)."""
        for owner, attr, old, had in reversed(self.patched):
            if had:
                setattr(owner, attr, old)
            else:
                delattr(owner, attr)
        self.patched.clear()


def instrument(parts: Parts, dec: CompiledTreeDecoder) -> None:
    """Every part of `CompiledTreeDecoder.step` but the line that syncs (its wait is what the parts leave over)."""
    drafter = dec.drafter
    parts.wrap(drafter.tokens_from, "propose", "propose: the replay's tokens (host)")
    drafts = "propose_on_device" if drafter.paced_by.needs.device == "tree" else "propose"
    parts.wrap(drafter.paced_by, drafts, f"propose: {drafter.paced_by.name}'s drafting")
    parts.wrap(Proposal, "limit", "proposal.limit")
    parts.wrap(Proposal, "as_tree", "proposal.as_tree")
    parts.wrap(dec, "layout", "layout (a shape seen before: a dict lookup)")
    parts.wrap(dec, "send", "send the ids")
    parts.wrap(dec, "verify", "verify (graph replay)")
    parts.wrap(compiled_tree, "greedy_tree_accept_on_device", "accept on the device")
    parts.wrap(dec.cache, "commit_path", "commit_path")
    parts.wrap(drafter, "commit", "drafter.commit")
    parts.wrap(dec, "_commit", "decoder._commit (tokens, EOS)")
    parts.wrap(compiled_tree, "Step", "Step record")
    parts.wrap(dec.budget, "update", "budget.update")
    parts.wrap(dec, "_record", "decoder._record")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def steps_of(dec: CompiledTreeDecoder, prompt: torch.Tensor, new: int, budget: int, parts: Parts | None = None):
    """Decode after `start`, step by step; host seconds of each whole step."""
    dec.start(prompt, new, budget=budget)
    if parts is not None:
        instrument(parts, dec)
    walls = []
    try:
        while not dec.done:
            t0 = time.perf_counter()
            dec.step()
            walls.append(time.perf_counter() - t0)
    finally:
        if parts is not None:
            parts.restore()
    sync(dec.model.device)
    return walls


def alone(fn, device: torch.device, n: int = 50) -> float:
    """Milliseconds per call of fn, n calls back to back, synced at the end (host and device pipelined)."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync(device)
    return 1e3 * (time.perf_counter() - t0) / n


def profile_table(dec, prompt, new, budget, rows: int) -> tuple[str, dict]:
    """torch.profiler over one run: the parts' ranges and the busiest ops, host (CPU) and device time."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if dec.model.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    parts = Parts()
    with torch.profiler.profile(activities=activities) as prof:
        n_steps = len(steps_of(dec, prompt, new, budget, parts))
    events = prof.key_averages()
    ranges = defaultdict(dict)
    for e in events:            # a part is two events: its range on the host, and its span on the device's timeline
        if e.key.startswith("## "):
            on_device = e.device_type != torch.autograd.DeviceType.CPU
            ranges[e.key[3:]]["device_span_ms_per_step" if on_device else "cpu_ms_per_step"] = (
                (e.device_time_total if on_device else e.cpu_time_total) / 1e3 / n_steps)
    kernels = sum(e.self_device_time_total for e in events if not e.key.startswith("## ")) / 1e3
    table = events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60)
    return table, {"ranges": dict(ranges), "kernels_ms_per_step": kernels / n_steps, "steps": n_steps}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="1.5b", choices=sorted(PAIRS))
    ap.add_argument("--replays", default="medusa-unpaced,medusa,eagle3",
                    help="medusa, eagle3 (each paced by its head's real cost), medusa-unpaced (no drafting cost)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--compile", default="blocks", choices=("blocks", "none"))
    ap.add_argument("--attention", default="sdpa", choices=ATTENTIONS,
                    help="the target's (and the EAGLE-3 head's) attention: torch's, or labkit's Triton kernel over "
                         "the static cache")
    ap.add_argument("--rows", type=int, default=40, help="profiler table rows")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--name", default="tree_step_profile")
    ap.add_argument("--out", default=str(ROOT / "data" / "bench"))
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("profile_tree_step.py profiles a CUDA GPU; on a CPU run it with --smoke (tiny shapes)")
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    name, target_args, _ = PAIRS[args.pair]
    target_args = SMOKE_ARGS if args.smoke else target_args
    how = dict(compile=False if args.compile == "none" else "blocks", cuda_graph=device.type == "cuda",
               compile_backend="eager" if args.smoke else "inductor")
    target = use_attention(sharpen(build(target_args, device, dtype)), args.attention)
    prompt = torch.randint(0, target.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0))
    new, max_len = args.new_tokens, args.prompt_len + args.new_tokens + 64
    ar = StaticDecoder(target, max_len=max_len, **how)
    ar.warmup()
    ar.generate(prompt, 16)
    gen = ar.generate(prompt, new)
    continuation = gen.tokens
    ar_step_ms = 1e3 * statistics.median(s.verify_time for s in gen.trace.steps[1:])
    del ar
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke: tiny shapes)",
              "pair": name, "dtype": str(dtype).removeprefix("torch."), "compile": how["compile"],
              "cuda_graph": how["cuda_graph"], "attention": args.attention, "prompt_len": args.prompt_len,
              "new_tokens": new,
              "ar_step_ms": ar_step_ms, "replays": {}}
    print(f"[profile] {result['device']}, {name}, AR step {ar_step_ms:.2f} ms", flush=True)
    dec = None
    for key in args.replays.split(","):
        source, method, category, _ = REPLAYS[key.removesuffix("-unpaced")]
        recorded = load_recorded_steps(ROOT / source, method, max_gamma=MAX_TREE, category=category)
        full = max(g for g, _ in recorded)
        mode = {"static": how, "attention": args.attention}
        replay, drafter = tree_drafter(key.removesuffix("-unpaced"), target, mode, continuation, recorded, max_len)
        if key.endswith("-unpaced"):                        # the tree loop's own cost: no drafter's work at all
            drafter = PacedDrafter(replay, CostOnly(lambda: None, "nothing"))
        if dec is None:
            dec = CompiledTreeDecoder(target, drafter, max_len, **how)
        else:
            dec.use_drafter(drafter)
        dec.warmup([full])
        dec.generate(prompt, 16, budget=full)
        # 1. the run as gpu_check times it
        walls = steps_of(dec, prompt, new, full)
        steps = dec.trace.steps
        rate = dec.trace.n_generated / (dec.trace.total_time - dec.trace.prefill_time)
        # 2. host seconds per part, no profiler
        parts = Parts()
        walls_parts = steps_of(dec, prompt, new, full, parts)
        n = len(walls_parts)
        host = {k: 1e3 * v / n for k, v in parts.seconds.items()}
        host["the rest: the sync's wait and the step's own lines"] = 1e3 * sum(walls_parts) / n - sum(host.values())
        # 3. the profiler
        table, prof = profile_table(dec, prompt, new, full, args.rows)
        # 4. the pieces alone
        tokens = torch.tensor(prompt.tolist() + continuation[:8])
        replay.start(prompt)
        piece = {"replay.propose (host)": alone(lambda: replay.propose(tokens, full, dec.sampling), device),
                 f"{drafter.paced_by.name}.propose": alone(
                     lambda: drafter.paced_by.propose(tokens, full, dec.sampling), device)}
        row = {"full": full, "tokens_per_s": rate, "speedup_over_ar": rate * ar_step_ms / 1e3,
               "tokens_per_step": dec.trace.tokens_per_forward, "steps": len(steps),
               "step_wall_ms": 1e3 * statistics.median(walls),
               "draft_window_ms": 1e3 * statistics.median(s.draft_time for s in steps),
               "verify_window_ms": 1e3 * statistics.median(s.verify_time for s in steps),
               "host_ms_per_step": host, "profiler": prof, "alone_ms": piece, "diverged": replay.diverged,
               "profile_table": scrub(table)}
        result["replays"][key] = row
        print(f"[{key}] {rate:.0f} tok/s ({row['speedup_over_ar']:.2f}x AR), step {row['step_wall_ms']:.2f} ms: "
              f"draft window {row['draft_window_ms']:.2f}, verify window {row['verify_window_ms']:.2f}; "
              f"kernels {prof['kernels_ms_per_step']:.2f} ms a step", flush=True)
        for k, v in host.items():
            r = prof["ranges"].get(k, {})
            print(f"    {v:7.3f} ms host  {r.get('device_span_ms_per_step', 0):7.3f} ms device span  {k}")
        for k, v in piece.items():
            print(f"    alone: {k} {v:.3f} ms")
        print(table, flush=True)
    write(result, Path(args.out), args.name)
    return result


def markdown(result: dict) -> str:
    lines = [f"# Where a compiled tree step's time goes: {result['device']} ({result['date']}, "
             f"torch {result['torch']})", "",
             f"{result['pair']}, {result['dtype']}, random weights of the real shapes, compile={result['compile']}, "
             f"CUDA graphs {result['cuda_graph']}, attention {result.get('attention', 'sdpa')}, "
             f"prompt {result['prompt_len']} tokens, {result['new_tokens']} new, "
             f"replayed acceptance. Compiled AR step: {result['ar_step_ms']:.2f} ms.", ""]
    if result.get("note"):
        lines += [result["note"], ""]
    for key, r in result["replays"].items():
        lines += [f"## {key} replay, {r['full']}-node trees: {r['tokens_per_s']:.0f} tok/s "
                  f"({r['speedup_over_ar']:.2f}x AR), {r['tokens_per_step']:.2f} tokens a step", "",
                  f"Median step {r['step_wall_ms']:.2f} ms on the host; the device's windows: drafting "
                  f"{r['draft_window_ms']:.2f} ms, verify {r['verify_window_ms']:.2f} ms"
                  + (f"; kernels {r['profiler']['kernels_ms_per_step']:.2f} ms a step (profiled run)."
                     if r["profiler"].get("kernels_ms_per_step") is not None else "."), "",
                  "Host: each part's own time, without the profiler. Device span (profiled run): from the first to "
                  "the last of the part's kernels on the device's timeline, gaps included.", "",
                  "| part of the step | host ms a step | device span ms a step |", "| --- | --- | --- |"]
        for k, v in r["host_ms_per_step"].items():
            d = r["profiler"]["ranges"].get(k, {}).get("device_span_ms_per_step")
            lines.append(f"| {k} | {v:.3f} | {'' if d is None else f'{d:.3f}'} |")
        lines += ["", "Alone, 50 calls back to back: " + "; ".join(f"{k} {v:.3f} ms" for k, v in r["alone_ms"].items()),
                  "", "```", r["profile_table"], "```", ""]
    return "\n".join(lines)


def write(result: dict, out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown(result))
    if extra := os.environ.get("OUT"):
        for suffix in (".json", ".md"):
            (Path(extra) / f"{name}{suffix}").write_text((out / f"{name}{suffix}").read_text())


if __name__ == "__main__":
    main()
