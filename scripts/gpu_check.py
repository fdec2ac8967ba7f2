"""Compiled speculation on a GPU, checked and timed in one run of under 8 minutes, from the repository alone.

1. Tests: the CUDA tests of the compiled and static decode paths (pytest; tiny fp32 models), with a time cap.
2. Timing, bf16, batch 1, random weights of the real shapes (a GPU box cannot download the checkpoints): the
   Qwen2.5-1.5B shape with the 0.5B draft shape, then the Llama-2-7B shape with the 0.5B draft shape (its
   vocabulary set to the 7B's) if time is left. Per pair and mode (CUDA graphs of eager kernels; torch.compile +
   CUDA graphs): compiled greedy decoding (StaticDecoder), compiled speculation with a zero-cost host drafter, and
   with the draft model paying its real cost; the eager loop (`speculative_generate`) on the same replay.
3. data/bench/gpu_spec.{json,md,png} (--name: another file name; copies in $OUT when it is set), rewritten after every
   phase. --tests all runs the whole unit tier first instead of the CUDA tests. --chat adds the cost-aware methods'
   chat replays (writing, qa and translation questions, where on a CPU they declined to draft most steps): their
   recorded steps, plain ones included, at this GPU's costs, to see whether declining costs anything there.
   --attention sdpa,triton runs every compiled mode with torch's attention and again with labkit's Triton kernel over
   the static cache (kernels/cache_attention.py), and first times that kernel alone against torch's in CUDA graphs.

Random weights cannot show acceptance, so every speculative number here is REPLAYED ACCEPTANCE
(labkit/drafters/replay.py): each step proposes the target's own continuation up to the length a real drafter
got accepted on the real pair on a CPU (data/bench/code_edit: prompt lookup, and suffix decoding with drafts of up to
16 tokens on a decoder built with max_gamma=16; data/bench/all_drafters: the cost-aware draft model; the Medusa and
EAGLE-3 trees of data/bench/eagle3_trees), then a wrong token. For that the target's greedy choice must not depend on rounding:
`sharpen` makes it follow a fixed random successor of the current token by a wide margin (a forward's time does
not depend on the weights' values). Speedups are over compiled greedy decoding in the same mode; "predicted" is
Leviathan's formula for the replayed acceptance and the measured draft and verify costs (labkit.bench.report).

    PYTHONPATH=. python3 scripts/gpu_check.py               # on a CUDA machine; make gpu-check
    PYTHONPATH=. python3 scripts/gpu_check.py --smoke       # tiny shapes on a CPU: the script's code path
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import replace
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_decode import timed  # noqa: E402  (the NVML-sampled second run)

from labkit import DraftModelDrafter, speculative_generate  # noqa: E402
from labkit.bench.report import ideal_speedup  # noqa: E402
from labkit.bench.runner import load_recorded_steps  # noqa: E402
from labkit.bench.writer import markdown_table, subplots, write_outputs  # noqa: E402
from labkit.decoding.compiled import CompiledSpeculativeDecoder, bucket, buckets_up_to  # noqa: E402
from labkit.decoding.compiled_tree import CompiledTreeDecoder, tree_bucket  # noqa: E402
from labkit.decoding.static import StaticDecoder  # noqa: E402
from labkit.drafters.eagle_device import DeviceEagleDrafter  # noqa: E402
from labkit.drafters.medusa import MedusaDrafter, medusa_tree
from labkit.drafters.replay import (  # noqa: E402
    PacedDrafter,
    ReplayDrafter,
    ReplayedBudget,
    ReplayedGamma,
    ReplayTreeDrafter,
)
from labkit.hw import SHAPES, decode_cost, describe, verify_cost  # noqa: E402
from labkit.kernels import cache_attention  # noqa: E402
from labkit.models.backends import ATTENTIONS, use_attention  # noqa: E402
from labkit.models.eagle_heads import Eagle3Head, EagleConfig
from labkit.models.medusa_heads import MedusaHeads
from labkit.models.transformer import ModelArgs, Transformer  # noqa: E402

TESTS = ["tests/test_compiled_speculative.py", "tests/test_compiled_tree.py", "tests/test_static_decode.py",
         "tests/test_cache_attention.py"]
# key: (results.jsonl, method, category or None, tree); chains are cut to 8 draft tokens (suffix decoding's to 16,
# the longest it drafts), trees to 64 nodes
REPLAYS = {"lookup": ("data/bench/code_edit/results.jsonl", "lookup", None, False),             # zero draft cost
           "suffix": ("data/bench/code_edit/results.jsonl", "suffix", None, False),             # zero draft cost
           "draft": ("data/bench/all_drafters/results.jsonl", "draft-cost-aware", None, False),  # the draft model's
           "medusa": ("data/bench/eagle3_trees/results.jsonl", "medusa", "coding", True),        # Medusa's heads'
           "eagle3": ("data/bench/eagle3_trees/results.jsonl", "eagle3-tree", "coding", True)}   # an EAGLE-3 head's
# --chat: the cost-aware methods on conversational questions, where they decline to draft most steps: their own
# recorded steps (the CPU's choices, plain steps included) at the GPU's costs
CHAT = ("writing", "qa", "translation")
CHAT_RUN = "data/bench/never_slower_repeats_amd-epyc-zen5/all_5_rounds_plain_step/questions_21/results.jsonl"
CHAT_REPLAYS = {f"{key}-chat": (CHAT_RUN, f"{key}-cost-aware", CHAT, tree)
                for key, tree in (("lookup", False), ("draft", False), ("suffix", True), ("medusa", True),
                                  ("eagle3", True))}
CAPS = {"suffix": 16}               # a chain replay's longest draft where not 8 (the compiled verify's widths)
LONGEST = max(CAPS.values())
HEADS = ROOT / "data" / "heads"
PAIRS = {"1.5b": ("qwen2.5-1.5b + 0.5b draft", SHAPES["qwen2.5-1.5b"], SHAPES["qwen2.5-0.5b"]),
         "7b": ("llama-2-7b + 0.5b draft (vocab 32000)", SHAPES["llama-2-7b"],
                replace(SHAPES["qwen2.5-0.5b"], vocab_size=32000, max_seq_len=4096))}
MODES = {"graphs": {"label": "CUDA graphs", "static": dict(compile=False, cuda_graph=True)},
         "blocks": {"label": "torch.compile per block + CUDA graphs", "trees": True,
                    "static": dict(compile="blocks", cuda_graph=True)},
         "compile": {"label": "torch.compile + CUDA graphs", "static": dict(compile=True, cuda_graph=True)}}
MAX_TREE = 64                       # Medusa's static tree: its 64 best paths (a budget takes its first nodes)
SMOKE_ARGS = ModelArgs(vocab_size=256, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=128, qkv_bias=True,
                       tie_embeddings=True, max_seq_len=512)


def build(args: ModelArgs, device: str, dtype: torch.dtype) -> Transformer:
    """A model of this shape with PyTorch's default random init, built on the device (as labkit.hw.random_model)."""
    with torch.device(device):
        return Transformer(args).to(dtype).eval().requires_grad_(False)


@torch.no_grad()
def sharpen(model: Transformer, seed: int = 0, embed_scale: float = 8.0) -> Transformer:
    """Make greedy decoding of a random model follow t -> succ(t), a fixed random permutation, by a wide margin.

    The embedding, scaled up, dominates the residual stream, and the LM head's row succ(t) is token t's (unscaled)
    embedding: the logit of succ(t) is ~D, every other one ~sqrt(D) (1536 against ~40 x 5 for the 1.5B shape), so
    no rounding difference between a 1-token step and a 9-token verify can flip the argmax. Same shapes, same bytes
    read per step (an untied head streams its own matrix as a tied one does).
    """
    embed = model.embed_tokens.weight                                            # (V, D)
    successor = torch.randperm(model.vocab_size, generator=torch.Generator().manual_seed(seed))
    head = torch.nn.Linear(embed.shape[1], embed.shape[0], bias=False, device=embed.device, dtype=embed.dtype)
    head.weight.copy_(embed[successor.argsort().to(embed.device)])               # row succ(t) = embedding of t
    model.lm_head = head.requires_grad_(False)
    embed.mul_(embed_scale)
    return model


class Budget:
    """Seconds left for the whole run; a phase that would not fit is skipped and listed."""

    def __init__(self, seconds: float):
        self.end, self.skipped = time.monotonic() + seconds, []

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self, need: float, what: str) -> bool:
        if self.left() >= need:
            return True
        self.skipped.append(f"{what} (needs ~{need:.0f} s, {self.left():.0f} s left)")
        print(f"[skip] {self.skipped[-1]}")
        return False


@contextmanager
def phase(result: dict, what: str):
    """Run a phase; an error in it is printed and recorded, and the run goes on to the next phase."""
    try:
        yield
    except Exception as e:            # a compile or capture failure must not lose the other phases' numbers
        traceback.print_exc()
        result["errors"].append(f"{what}: {type(e).__name__}: {e}"[:2000])
        print(f"[error] {result['errors'][-1]}", flush=True)


def scrub(text: str) -> str:
    """No paths of the machine in the outputs: the repository's become relative, Python's and its packages' short."""
    text = text.replace(str(ROOT) + "/", "")
    text = re.sub(r"/\S*/site-packages/", "site-packages/", text)
    return re.sub(r"/\S*/(python3\.\d+)/", r"\1/", text)


def run_tests(seconds: float, which: str = "cuda") -> dict:
    """The CUDA tests of the static and compiled loops (-k cuda), or the whole unit tier (`which` = "all": tests/),
    killed after `seconds`."""
    if importlib.util.find_spec("pytest") is None:
        return {"rc": None, "summary": "pytest is not installed here: tests not run", "seconds": 0.0}
    # spread over the CPU's cores where pytest-xdist is installed: each test compiles its own small shapes (on an
    # H200's 16 cores the CUDA tests take about 75 s on 8 workers, and did not finish in 230 s on one)
    most, cores = (14 if which == "all" else 8), os.cpu_count() or 2
    n = max(1, min(most, cores - 2)) if importlib.util.find_spec("xdist") is not None else 1
    workers = ["-n", str(n)] if n > 1 else []
    # each worker's torch would start a thread per core and inductor a compile process per core: 14 workers on 16
    # cores, oversubscribed, took 2-3 minutes over single CPU-bound tests (gpu_unit_tier_h200_second.md)
    threads = {"OMP_NUM_THREADS": str(max(1, cores // n)), "TORCHINDUCTOR_COMPILE_THREADS": "1"} if n > 1 else {}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-k", "cuda", "-p", "no:cacheprovider", *workers, *TESTS]
    if which == "all":
        cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *workers, "tests"]
    print("[tests]", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=seconds,
                              env={**os.environ, **threads, "PYTHONPATH": os.pathsep.join(
                                  filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
        rc, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        rc, out = "timeout", f"{text(e.stdout)}{text(e.stderr)}\nkilled after {seconds:.0f} s"
    out = scrub(out)
    lines = [line for line in out.strip().splitlines() if line.strip()]
    print("\n".join(lines[-15:]), flush=True)
    return {"rc": rc, "which": which, "command": " ".join(["pytest", *cmd[3:]]), "summary": lines[-1] if lines else "",
            "seconds": time.perf_counter() - t0, "tail": lines[-60:]}


def decode_rate(gen, first_from_prefill: bool) -> float:
    """Tokens per second of the decode phase (prefill excluded; its token too, where it makes one)."""
    n = gen.trace.n_generated - (1 if first_from_prefill else 0)
    return n / (gen.trace.total_time - gen.trace.prefill_time)


def spec_row(label: str, gen, drafter: ReplayDrafter, continuation: list[int], ar: dict, target_args, draft_args,
             context: int, peak: float | None, tree: bool = False, full: int = 8, follows: bool = False,
             **extra) -> dict:
    """A speculative run's numbers beside the compiled AR baseline of its pair and mode (a tree run's: tree=True,
    `full` nodes asked a step; follows: its γ or tree size came from the recording, ReplayedGamma / ReplayedBudget)."""
    steps = gen.trace.steps
    rate = decode_rate(gen, first_from_prefill=False)
    as_lists = [[s.gamma, s.n_accepted, int(s.bonus), s.draft_time, s.verify_time] for s in steps]
    # predicted from the replayed steps themselves: tokens committed per AR step's worth of measured drafting and
    # verifying (the tree analogue of Leviathan's formula, and his formula's own value for i.i.d. acceptance at a
    # fixed γ); his closed form at the mean acceptance rate and the mean γ is given beside it: for a drafter whose
    # γ varies from step to step (lookup: 1-8) and whose acceptance comes in runs, it predicts other tokens a step
    predicted = ideal_speedup(as_lists, [[0, 0, 1, 0.0, ar["step_s"]]], tree=True)
    closed_form = None if tree else ideal_speedup(as_lists, [[0, 0, 1, 0.0, ar["step_s"]]])
    width = tree_bucket if tree else partial(bucket, buckets=buckets_up_to(LONGEST))
    nbytes = sum(verify_cost(target_args, max(1, width(s.gamma)), context).bytes for s in steps)   # padded widths
    if draft_args is not None:                      # about one draft forward per draft token (catch-ups included)
        nbytes += sum(s.gamma for s in steps) * decode_cost(draft_args, context).bytes
    drafted = [s for s in steps if s.gamma]
    # the recording, cycled, against what ran, up to the steps whose draft max_new_tokens cut short (the last few)
    replayed = [(s.gamma, s.n_accepted) for s in steps if s.asked == full]
    recorded = (drafter.recorded * (len(steps) // len(drafter.recorded) + 1))[:len(replayed)]
    if follows:       # every step: what the replay set up, each its recorded step, cut only where the run's end capped it
        replayed, recorded = [(s.gamma, s.n_accepted) for s in steps], drafter.replayed[:len(steps)]
        cycled = (drafter.recorded * (len(steps) // len(drafter.recorded) + 1))[:len(recorded)]
        if not all(g <= g_rec and n == min(n_rec, g) for (g, n), (g_rec, n_rec) in zip(recorded, cycled)):
            recorded = cycled
    row = {"method": label, "tokens_per_s": rate, "speedup": rate / ar["tokens_per_s"], "predicted_speedup": predicted,
           "leviathan_closed_form_speedup": closed_form,
           "measured_over_predicted": rate / ar["tokens_per_s"] / predicted if predicted else None,
           "tokens_per_step": gen.trace.tokens_per_forward, "acceptance_rate": gen.trace.acceptance_rate,
           "replay_equals_recorded": replayed == recorded,
           "recorded_tokens_per_step": sum(n + 1 for _, n in recorded) / max(1, len(recorded)),
           "replayed_tokens_per_step": sum(n + 1 for _, n in replayed) / max(1, len(replayed)),
           "tokens_equal_continuation": gen.tokens == continuation[:len(gen.tokens)] and not drafter.diverged,
           "draft_ms_per_token": 1e3 * sum(s.draft_time for s in drafted) / max(1, sum(s.gamma for s in drafted)),
           "verify_ms": 1e3 * sum(s.verify_time for s in steps) / len(steps),
           "achieved_bandwidth": nbytes / (gen.trace.total_time - gen.trace.prefill_time)}
    row["fraction_of_peak"] = row["achieved_bandwidth"] / peak if peak else None
    print(f"  {label}: {rate:.0f} tok/s, {row['speedup']:.2f}x over compiled AR (predicted "
          f"{predicted or float('nan'):.2f}x)\n    (γ, accepted) replayed {replayed[:8]}...\n"
          f"                       recorded {recorded[:8]}...\n    tokens a step replayed "
          f"{row['replayed_tokens_per_step']:.3f}, recorded {row['recorded_tokens_per_step']:.3f}, over "
          f"{len(replayed)} steps: equal {row['replay_equals_recorded']}; tokens = AR's: "
          f"{row['tokens_equal_continuation']}", flush=True)
    return {**row, **extra}


def replay_drafter(key: str, result: dict, continuation: list[int], target: Transformer, draft: Transformer | None):
    """The replay of `key`'s recording: alone (zero draft cost), or paced by the draft model (its real cost)."""
    replay = ReplayDrafter(continuation, result["recorded"][key]["steps"], target.vocab_size)
    return replay, replay if draft is None else PacedDrafter(replay, DraftModelDrafter(draft))


def bench_mode(name: str, target: Transformer, draft: Transformer, mode: dict, prompt: torch.Tensor, new: int,
               result: dict, budget: Budget, peak: float | None) -> tuple[dict, list[int]]:
    """Compiled AR, then compiled speculation with each replay, in one mode; (the AR row, the AR's tokens)."""
    max_len, compiling = prompt.numel() + new + LONGEST, bool(mode["static"].get("compile", False))
    for model in (target, draft):                   # torch's attention, or labkit's Triton kernel over the cache
        use_attention(model, mode.get("attention", "sdpa"))
    per_shape = result["per_shape_compile_s"]
    rows = []
    result["runs"].append({"pair": name, "mode": mode["label"], "prompt_len": prompt.numel(), "new_tokens": new,
                           "rows": rows})
    sample = timed if target.device.type == "cuda" else (lambda fn, label: (fn(), None))
    # 1. compiled greedy decoding: the baseline, and the target's continuation that the replays propose
    t0 = time.perf_counter()
    ar_dec = StaticDecoder(target, max_len=max_len, **mode["static"])
    ar_dec.warmup()
    compile_s = time.perf_counter() - t0
    gen, util = sample(partial(ar_dec.generate, prompt, new), "AR")
    continuation, rate = gen.tokens, decode_rate(gen, True)
    ar = {"method": f"compiled AR (StaticDecoder, {mode['label']})", "tokens_per_s": rate, "speedup": 1.0,
          "compile_s": compile_s, "nvml_dram_bw_util_pct": util,
          "step_s": statistics.median(s.verify_time for s in gen.trace.steps[1:]),
          "achieved_bandwidth": decode_cost(target.args, max_len).bytes * rate}
    ar["fraction_of_peak"] = ar["achieved_bandwidth"] / peak if peak else None
    rows.append(ar)
    print(f"  compiled AR: {rate:.0f} tok/s, warm-up (compile/capture) {compile_s:.1f} s", flush=True)
    del ar_dec
    if compiling:                          # what one compiled shape of this pair costs: the estimate for the rest
        per_shape[mode["label"]] = compile_s
    # 2. compiled speculation, replaying each recorded acceptance; one decoder, so the second drafter reuses the
    #    verify shapes the first compiled
    compiled, dec = set(), None
    chains = [k for k in result["recorded"] if not result["recorded"][k]["tree"]]
    for key, draft_model in ((k, draft if k.startswith("draft") else None) for k in chains):
        recorded, cap = result["recorded"][key]["steps"], CAPS.get(key, 8)
        shapes = {("verify", bucket(g, buckets_up_to(LONGEST))) for g, _ in recorded} | ({("draft", 1), ("draft", 2)} if draft_model else set())
        need = len(shapes - compiled) * per_shape.get(mode["label"], 40.0) + 20 if compiling else 20
        if not budget.allows(need, f"{name}, {mode['label']}, replay {key}"):
            continue
        compiled |= shapes
        with phase(result, f"{name}, {mode['label']}, replay {key}"):
            replay, drafter = replay_drafter(key, result, continuation, target, draft_model)
            t0 = time.perf_counter()
            if dec is None:
                dec = CompiledSpeculativeDecoder(target, drafter, max_len, max_gamma=LONGEST, **mode["static"])
            else:
                dec.use_drafter(drafter)
            dec.warmup(g for g, _ in recorded)
            # a chat replay's γ comes from its recording, plain steps included, as its cost-aware policy chose them
            gamma = ReplayedGamma(replay) if key.endswith("-chat") else cap
            dec.generate(prompt, 16, gamma=gamma)  # a first run's eager glue (acceptance, commit) loads its kernels
            compile_s = time.perf_counter() - t0
            gen, util = sample(partial(dec.generate, prompt, new, gamma=gamma), key)
            label = (f"compiled speculation ({mode['label']}), replayed {result['recorded'][key]['method']} "
                     f"{acceptance_of(result['recorded'][key])}, "
                     + ("zero draft cost" if draft_model is None else "the draft model's real cost"))
            rows.append(spec_row(label, gen, replay, continuation, ar, target.args,
                                 None if draft_model is None else draft_model.args, max_len, peak, full=cap,
                                 follows=key.endswith("-chat"), replay=key, compile_s=compile_s,
                                 nvml_dram_bw_util_pct=util))
    del dec
    if mode.get("trees"):
        bench_trees(name, target, mode, prompt, new, continuation, ar, result, budget, peak, rows)
    return ar, continuation


def eagle3_drafter(target: Transformer, mode: dict, max_len: int, top_k: int = 8, depth: int = 6
                   ) -> DeviceEagleDrafter:
    """labkit's EAGLE-2 tree drafting on the device (DeviceEagleDrafter) with a random EAGLE-3 head of the shipped
    one's shape (data/heads/eagle3-*: one layer, the fusion of three target blocks, an 11,863-token draft
    vocabulary), compiled and recorded as CUDA graphs where the mode's verify is: its real drafting, every step."""
    config = json.loads(next(HEADS.glob("eagle3-*/config.json")).read_text())
    fields = {f: config[f] for f in ("dim", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "norm_eps",
                                     "rope_theta", "layers")}
    n = target.args.n_layers
    layers = fields["layers"] if max(fields["layers"]) < n else [0, n // 2, n - 1]    # a smoke run's few blocks
    vocab = torch.arange(min(config["draft_vocab_size"], target.vocab_size))
    cfg = replace(EagleConfig(**fields), dim=target.args.dim, layers=layers, draft_vocab_size=vocab.numel())
    torch.manual_seed(0)
    head = Eagle3Head(cfg, target.vocab_size, max_seq_len=max_len)
    head = head.to(target.device, target.embed_tokens.weight.dtype).eval().requires_grad_(False)
    use_attention(head, mode.get("attention", "sdpa"))                  # its layer's attention as the target's
    how = mode["static"]
    return DeviceEagleDrafter(head, target, vocab, top_k=top_k, depth=depth, max_len=max_len,
                              compile=how.get("compile", False), cuda_graph=how.get("cuda_graph", False),
                              compile_backend=how.get("compile_backend", "inductor"))


def tree_drafter(key: str, target: Transformer, mode: dict, continuation: list[int], recorded: list, max_len: int):
    """(the replay, the replay paced by its head's real cost): Medusa's four heads on the target's LM head
    (MedusaDrafter itself, random weights) or EAGLE-3's tree drafting on the device (eagle3_drafter)."""
    replay = ReplayTreeDrafter(continuation, recorded, target.vocab_size, depth=6)
    key = key.removesuffix("-chat")
    if key == "suffix":                                              # suffix decoding drafts on the host: free
        return replay, replay
    if key == "medusa":
        config = json.loads(next(HEADS.glob("medusa-*/config.json")).read_text())
        heads = MedusaHeads(target.lm_head, config["n_heads"]).to(target.device)
        paced_by = MedusaDrafter(heads, medusa_tree(torch.tensor(config["topk_accuracy"]), MAX_TREE))
    else:
        paced_by = eagle3_drafter(target, mode, max_len)
    return replay, PacedDrafter(replay, paced_by)


def bench_trees(name: str, target: Transformer, mode: dict, prompt: torch.Tensor, new: int, continuation: list[int],
                ar: dict, result: dict, budget: Budget, peak: float | None, rows: list) -> None:
    """Compiled tree speculation replaying Medusa's and EAGLE-3's coding acceptance, each paced by its head's real
    cost: Medusa's four heads on the target's LM head (MedusaDrafter itself, random weights), EAGLE-3's tree drafting
    on the device (eagle3_drafter), which reads three blocks' outputs from the verify. One decoder: the second reuses the verify shape the first compiled."""
    max_len, dec, compiled = prompt.numel() + new + 64, None, set()
    for key in (k for k in result["recorded"] if result["recorded"][k]["tree"]):
        recorded = result["recorded"][key]["steps"]
        full, sizes = max(g for g, _ in recorded), {tree_bucket(min(g, MAX_TREE)) for g, _ in recorded}
        per_shape_s = result["per_shape_compile_s"].get(mode["label"], 40.0)
        need = len(sizes - compiled) * per_shape_s + 30
        if not budget.allows(need, f"{name}, {mode['label']}, tree replay {key}"):
            continue
        compiled |= sizes
        with phase(result, f"{name}, {mode['label']}, tree replay {key}"):
            t0 = time.perf_counter()
            replay, drafter = tree_drafter(key, target, mode, continuation, recorded, max_len)
            if dec is None:
                dec = CompiledTreeDecoder(target, drafter, max_len, **mode["static"])
            else:
                dec.use_drafter(drafter)
            dec.warmup(sorted(sizes))
            nodes = ReplayedBudget(replay) if key.endswith("-chat") else full       # as for the chains' γ
            dec.generate(prompt, 16, budget=nodes)  # a first run's eager glue (acceptance, commit) loads its kernels
            compile_s = time.perf_counter() - t0
            sample = timed if target.device.type == "cuda" else (lambda fn, label: (fn(), None))
            gen, util = sample(partial(dec.generate, prompt, new, budget=nodes), key)
            base = key.removesuffix("-chat")
            label = (f"compiled tree speculation ({mode['label']}), replayed {result['recorded'][key]['method']} "
                     f"{acceptance_of(result['recorded'][key])}, trees of up to {full} nodes, "
                     + {"medusa": "the Medusa heads' real cost", "suffix": "zero draft cost",
                        "eagle3": "the EAGLE-3 head's real cost, its tree grown on the device (DeviceEagleDrafter)"
                        }[base])
            rows.append(spec_row(label, gen, replay, continuation, ar, target.args, None, max_len, peak, tree=True,
                                 full=full, follows=key.endswith("-chat"), replay=key, compile_s=compile_s,
                                 nvml_dram_bw_util_pct=util, per_shape_estimate_s=per_shape_s))
    del dec


def acceptance_of(recorded: dict) -> str:
    """How a table names a replay's acceptance: its questions' category (or categories)."""
    category = recorded["category"]
    if category is None:
        return "acceptance"
    if isinstance(category, str):
        return f"{category} acceptance"
    return f"chat acceptance ({', '.join(category)}: its recorded choices, plain steps included)"


def bench_eager(name: str, target: Transformer, draft: Transformer, prompt: torch.Tensor, new: int,
                continuation: list[int], ar: dict, result: dict, budget: Budget, peak: float | None) -> None:
    """labkit's eager loop (`speculative_generate`) on the same replays, against the fastest compiled AR."""
    rows = []
    result["runs"].append({"pair": name, "mode": "eager loop", "prompt_len": prompt.numel(), "new_tokens": new,
                           "rows": rows})
    for key, draft_model in (("lookup", None), ("draft", draft)):
        if not budget.allows(40 if draft_model is None else 90, f"{name}, eager loop, replay {key}"):
            continue
        with phase(result, f"{name}, eager loop, replay {key}"):
            replay, drafter = replay_drafter(key, result, continuation, target, draft_model)
            speculative_generate(target, drafter, prompt, 8, gamma=8)                    # warm-up
            gen = speculative_generate(target, drafter, prompt, new, gamma=8)
            rows.append(spec_row(f"eager loop (speculative_generate), replayed {result['recorded'][key]['method']} "
                                 "acceptance, " + ("zero draft cost" if draft_model is None else
                                                   "the draft model's real cost") + f"; speedup over {ar['method']}",
                                 gen, replay, continuation, ar, target.args,
                                 None if draft_model is None else draft_model.args, prompt.numel() + new + 8, peak,
                                 replay=key))


def bench_transformers(name: str, target_args: ModelArgs, prompt: torch.Tensor, new: int, ar: dict, result: dict,
                       budget: Budget, peak: float | None) -> None:
    """transformers' `generate` with `cache_implementation="static"` (it compiles the forward and records CUDA
    graphs itself) on a model of the same shape, random weights, greedy, exactly `new` tokens."""
    if importlib.util.find_spec("transformers") is None:
        result["skipped"].append(f"{name}: transformers is not installed here")
        return
    if not budget.allows(150, f"{name}, transformers static-cache generate"):
        return
    import transformers
    a = target_args
    kind = transformers.Qwen2Config if a.qkv_bias else transformers.LlamaConfig
    config = kind(vocab_size=a.vocab_size, hidden_size=a.dim, intermediate_size=a.hidden_dim,
                  num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads,
                  max_position_embeddings=a.max_seq_len, rope_theta=a.rope_theta, rms_norm_eps=a.norm_eps,
                  tie_word_embeddings=a.tie_embeddings)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16).eval()
    ids = prompt[None].cuda()
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static",
              pad_token_id=0)
    t0 = time.perf_counter()
    model.generate(ids, **kw)                                       # compiles and records its graphs
    compile_s = time.perf_counter() - t0

    def run():
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, **kw)
        torch.cuda.synchronize()
        return out, time.perf_counter() - t
    (out, seconds), util = timed(run, "transformers")
    n = out.shape[1] - ids.shape[1]
    rate = n / seconds
    row = {"replay": "transformers", "method": f"transformers {transformers.__version__} generate, cache_implementation='static' (end to end, "
                     "prefill included)", "tokens_per_s": rate, "speedup": rate / ar["tokens_per_s"],
           "compile_s": compile_s, "nvml_dram_bw_util_pct": util, "new_tokens": n,
           "achieved_bandwidth": decode_cost(target_args, prompt.numel() + new).bytes * rate}
    row["fraction_of_peak"] = row["achieved_bandwidth"] / peak if peak else None
    result["runs"].append({"pair": name, "mode": "transformers", "prompt_len": prompt.numel(), "new_tokens": new,
                           "rows": [row]})
    print(f"  transformers static-cache generate: {rate:.0f} tok/s ({row['speedup']:.2f}x labkit's fastest compiled "
          f"AR), warm-up {compile_s:.0f} s", flush=True)


def markdown(result: dict) -> str:
    d = result["device"]
    lines = [f"# Compiled speculation on {d['name']} ({result['date']}, {result['torch']})", "",
             f"**Replayed acceptance**: random weights of the real shapes, {result['dtype']}, batch 1; each step "
             "proposes the "
             "target's own continuation up to the length a real drafter got accepted on the real pair (recorded on a "
             "CPU), then a wrong token (labkit/drafters/replay.py). Speedups are over compiled greedy decoding in the "
             "same mode; predicted: the replayed steps' committed tokens per AR step's worth of their measured drafting and "
             "verifying (Leviathan's expected speedup, step by step; the tree analogue for trees); his closed form "
             "at the mean acceptance rate and mean γ beside it (it assumes i.i.d. acceptance at a fixed γ).", "",
             f"Tests ({result['tests'].get('command', ' '.join(TESTS) + ' -k cuda')}): "
             f"{result['tests'].get('summary', 'not run')}", ""]
    for key, rec in result["recorded"].items():
        lines.append(f"- replay `{key}`: {rec['method']} from {rec['source']}: {rec['tokens_per_step']:.2f} tokens a "
                     f"step, acceptance {rec['acceptance_rate']:.2f}, γ capped at {rec.get('longest', 8)}")
    rows = [{"pair": s["pair"], "mode": s["mode"], **r} for s in result["runs"] for r in s["rows"]]
    opt = lambda key, fmt: lambda r: fmt.format(r[key]) if r.get(key) is not None else "n/a"  # noqa: E731
    lines += [""] + markdown_table(rows, {
        "pair": "{pair}", "mode": "{mode}", "method": "{method}", "tokens/s": "{tokens_per_s:.0f}",
        "speedup": "{speedup:.2f}x", "predicted": opt("predicted_speedup", "{:.2f}x"),
        "Leviathan closed form": opt("leviathan_closed_form_speedup", "{:.2f}x"),
        "measured/predicted": opt("measured_over_predicted", "{:.2f}"), "tokens/step": opt("tokens_per_step", "{:.2f}"),
        "draft ms/token": opt("draft_ms_per_token", "{:.2f}"), "verify ms": opt("verify_ms", "{:.2f}"),
        "% of peak HBM": lambda r: f"{100 * r['fraction_of_peak']:.0f}" if r.get("fraction_of_peak") else "n/a",
        "NVML DRAM util %": opt("nvml_dram_bw_util_pct", "{:.0f}"), "compile s": opt("compile_s", "{:.1f}"),
        "replay = recorded": lambda r: str(r.get("replay_equals_recorded", "-")),
        "tokens = AR": lambda r: str(r.get("tokens_equal_continuation", "-"))})
    if result.get("attention_kernel"):
        lines += ["", "Attention over the static cache, one call recorded in a CUDA graph and replayed "
                  "(kernels/cache_attention.py; median microseconds; the step's tokens see half the cache, "
                  "the rest is its unused tail):", ""]
        lines += markdown_table(result["attention_kernel"], {
            "shape": "{shape}", "heads (q/kv x dim)": "{heads}", "cache slots": "{slots}", "cached": "{cached}",
            "tokens": "{tokens}", "Triton us": "{triton_us:.1f}", "torch SDPA us": "{sdpa_us:.1f}",
            "SDPA / Triton": "{sdpa_over_triton:.2f}", "max abs err": "{max_abs_err:.1e}"})
    lines += ["", f"Peak bandwidth: {d.get('peak_bandwidth_source')}. Skipped: {result['skipped'] or 'nothing'}. "
              f"Errors: {result['errors'] or 'none'}. Total {result.get('seconds', 0):.0f} s."]
    return "\n".join(lines) + "\n"


def plot(result: dict):
    runs = result["runs"] or [{"pair": "none", "mode": "", "rows": []}]
    fig, axes = subplots(1, len(runs), figsize=(4.5 * len(runs), 4), squeeze=False)
    for ax, run in zip(axes[0], runs):
        vals = [r["tokens_per_s"] for r in run["rows"]]
        colors = {"AR": "C7", "lookup": "C2", "suffix": "C5", "draft": "C1", "medusa": "C4", "eagle3": "C3", "transformers": "C0"}
        bars = ax.bar(range(len(vals)), vals, color=[colors[r.get("replay", "AR").removesuffix("-chat")]
                                                     for r in run["rows"]],
                      hatch=[("//" if r.get("replay", "").endswith("-chat") else "") for r in run["rows"]])
        for b, r in zip(bars, run["rows"]):
            ax.annotate(f"{r['speedup']:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                        va="bottom", fontsize=8)
        labels = [r.get("replay", "AR") for r in run["rows"]]
        ax.set_xticks(range(len(vals)), labels, fontsize=7)
        ax.set(ylabel="tokens/s", title=f"{run['pair']}\n{run['mode']}", xlabel="replayed drafter (speedup over AR)")
    fig.suptitle(f"replayed acceptance, {result['device']['name']}", fontsize=9)
    fig.tight_layout()
    return fig


def write(result: dict, out: Path) -> None:
    paths = write_outputs(out / result["name"], result, markdown, plot)
    if args_out := os.environ.get("OUT"):
        for p in paths:
            shutil.copy(p, Path(args_out) / p.name)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=440, help="seconds for everything (tests included)")
    ap.add_argument("--test-seconds", type=float, default=160)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, steps traced, no tests or graphs")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--chat", action="store_true", help="also the cost-aware methods' chat replays (" + ", ".join(CHAT)
                    + "): their recorded steps, mostly plain, at this GPU's costs")
    ap.add_argument("--tests", choices=("cuda", "all"), default="cuda",
                    help="cuda: the CUDA tests of the compiled loops; all: the whole unit tier (tests/)")
    ap.add_argument("--tree-pairs", default="1.5b", help="the pairs whose target also runs the tree replays")
    ap.add_argument("--name", default="gpu_spec", help="the outputs' file name, in --out: NAME.{json,md,png}")
    ap.add_argument("--pairs", default="1.5b,7b", help="which target shapes, in order: 1.5b (Qwen2.5), 7b (Llama-2)")
    ap.add_argument("--modes", default="graphs,blocks",
                    help="graphs (eager kernels), blocks (inductor, a block at a time), compile (inductor, the whole "
                         "forward), in order")
    ap.add_argument("--attention", default="sdpa",
                    help="the attention each compiled mode runs, in turn: sdpa (torch's), triton (labkit's kernel "
                         "over the static cache, kernels/cache_attention.py; also timed alone in CUDA graphs), "
                         "e.g. sdpa,triton")
    ap.add_argument("--peers", default="transformers", help="'transformers' (static-cache generate), or ''")
    ap.add_argument("--out", default=str(ROOT / "data" / "bench"))
    args = ap.parse_args(argv)
    unknown = sorted(set(args.pairs.split(",")) - set(PAIRS) | set(args.modes.split(",")) - set(MODES)
                     | set(filter(None, args.tree_pairs.split(","))) - set(PAIRS))
    if unknown:
        raise SystemExit(f"unknown --pairs/--modes {unknown}: pairs {list(PAIRS)}, modes {list(MODES)}")
    attentions = args.attention.split(",")
    if not attentions or set(attentions) - set(ATTENTIONS):
        raise SystemExit(f"--attention {args.attention!r}: choose from {', '.join(ATTENTIONS)}, comma-separated")
    t_start, budget, out = time.perf_counter(), Budget(args.budget), Path(args.out)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("gpu_check.py measures a CUDA GPU; on a CPU run it with --smoke (tiny shapes)")
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    print(f"[env] torch {torch.__version__}, device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}",
          flush=True)
    profile = describe(device, quick=args.smoke)
    peak = profile.facts.get("peak bandwidth")
    peak_bw = getattr(peak, "value", None) if device == "cuda" else None
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": f"torch {torch.__version__}",
              "device": {"name": profile.name, "peak_bandwidth": getattr(peak, "value", None),
                         "peak_bandwidth_source": getattr(peak, "source", str(peak)),
                         "copy_bandwidth": profile.bandwidth.value},
              "dtype": "float32 (smoke: tiny shapes)" if args.smoke else "bf16",
              "label": "replayed acceptance", "tests": {}, "recorded": {}, "runs": [], "skipped": budget.skipped,
              "errors": [], "name": args.name,
              "per_shape_compile_s": {}}            # per mode, the first compile measured (a guess of 40 s before)
    for key, (source, method, category, tree) in {**REPLAYS, **(CHAT_REPLAYS if args.chat else {})}.items():
        steps = load_recorded_steps(ROOT / source, method, max_gamma=MAX_TREE if tree else CAPS.get(key, 8),
                                    category=category)
        accepted, proposed = sum(n for _, n in steps), sum(g for g, _ in steps)
        result["recorded"][key] = {"source": source, "method": method, "category": category, "steps": steps,
                                   "tokens_per_step": (accepted + len(steps)) / len(steps),
                                   "acceptance_rate": accepted / max(1, proposed),
                                   "longest": MAX_TREE if tree else CAPS.get(key, 8), "tree": tree}
    if args.smoke:
        dtype, pairs = torch.float32, [("smoke", SMOKE_ARGS, replace(SMOKE_ARGS, n_layers=1), True)]
        modes = [{"label": "static, traced a block at a time (smoke)", "trees": True,
                  "static": dict(compile="blocks", compile_backend="eager")}]
    else:
        dtype = torch.bfloat16
        pairs = [(*PAIRS[p], p in args.tree_pairs.split(",")) for p in args.pairs.split(",")]
        modes = [MODES[m] for m in args.modes.split(",")]
    modes = [{**mode, "attention": a, "label": mode["label"] + ("" if a == "sdpa" else ", Triton attention")}
             for mode in modes for a in attentions]
    # 1. tests
    if not (args.smoke or args.skip_tests):
        result["tests"] = run_tests(min(args.test_seconds, budget.left() - 60), args.tests)
        write(result, out)
    # 2. the Triton attention alone against torch's, each in a CUDA graph, at the shapes the loops below run
    if "triton" in attentions and device == "cuda" and budget.allows(60, "cache attention kernel"):
        print(f"[bench] cache attention kernel ({budget.left():.0f} s left)", flush=True)
        with phase(result, "cache attention kernel"):
            result["attention_kernel"] = cache_attention.benchmark()
        write(result, out)
    # 3. timing: pairs x modes, the cheapest first, each only if it fits what is left
    first = None
    for i, (name, target_args, draft_args, trees) in enumerate(pairs):
        if not budget.allows(60, f"{name}: every mode"):
            continue
        target = sharpen(build(target_args, device, dtype))        # one pair of models for every mode: one continuation
        draft = build(draft_args, device, dtype)
        prompt = torch.randint(0, target.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0))
        fastest_ar = None
        for mode in modes:
            # graphs alone capture in seconds; a compiled mode compiles its AR step, then each replay's shapes
            guess = 40.0 if mode["static"].get("compile") is True else 10.0
            need = 2 * result["per_shape_compile_s"].get(mode["label"], guess) + 30 \
                if mode["static"].get("compile") and not args.smoke else 30
            if not budget.allows(need, f"{name}, {mode['label']}"):
                continue
            print(f"[bench] {name}, {mode['label']} ({budget.left():.0f} s left)", flush=True)
            with phase(result, f"{name}, {mode['label']}"):
                ar, continuation = bench_mode(name, target, draft, {**mode, "trees": mode.get("trees") and trees},
                                              prompt, args.new_tokens, result, budget, peak_bw)
                if fastest_ar is None or ar["tokens_per_s"] > fastest_ar["tokens_per_s"]:
                    fastest_ar = ar
            result["seconds"] = time.perf_counter() - t_start
            write(result, out)
        for model in (target, draft):
            use_attention(model, "sdpa")
        if i == 0 and fastest_ar is not None:                   # the eager loop: once, on the first pair
            print(f"[bench] {name}, eager loop ({budget.left():.0f} s left)", flush=True)
            with phase(result, f"{name}, eager loop"):
                bench_eager(name, target, draft, prompt, args.new_tokens, continuation, fastest_ar, result, budget,
                            peak_bw)
        if i == 0 and fastest_ar is not None:
            first = (name, target_args, prompt, fastest_ar)
        del target, draft
        torch._dynamo.reset()                                   # the compiled code and graphs of this pair's models
        if device == "cuda":
            torch.cuda.empty_cache()
        result["seconds"] = time.perf_counter() - t_start
        write(result, out)
    # 4. transformers' own compiled decoding on the first pair's target shape, last: it compiles for minutes
    if first is not None and not args.smoke and "transformers" in args.peers:
        name, target_args, prompt, fastest_ar = first
        print(f"[bench] {name}, transformers ({budget.left():.0f} s left)", flush=True)
        with phase(result, f"{name}, transformers static-cache generate"):
            bench_transformers(name, target_args, prompt, args.new_tokens, fastest_ar, result, budget, peak_bw)
    result["seconds"] = time.perf_counter() - t_start
    write(result, out)
    print(markdown(result), flush=True)
    return result


if __name__ == "__main__":
    main()
