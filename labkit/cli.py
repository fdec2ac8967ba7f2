"""`python -m labkit ...`: generate with or without speculation, list and fetch the models.

    python -m labkit generate --drafter draft --gamma 5 --temperature 0 --max-new-tokens 64 --prompt "..."
    python -m labkit generate --drafter lookup --json --prompt "..."     # one JSON object on stdout
    python -m labkit models | python -m labkit fetch
    python -m labkit bench --questions data/questions/labkit_bench.jsonl --limit 2 --out /tmp/bench
    python -m labkit verify-cost                  # forward time vs tokens per forward, every path
    python -m labkit lab                          # JupyterLab on the notebooks (make lab)
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from functools import partial
from pathlib import Path

import torch

from .drafters.draft_model import DEFAULT_WINDOW
from .drafters.vocab import DEFAULT_VOCAB
from .models.layer_skip import CALIBRATION_TOKENS

DRAFTERS = ("draft", "lookup", "none")
# train WHAT: the module whose main runs it, and what it makes (each keeps its own options)
TRAINERS = {"distill": ("labkit.training.distill", "the target's own answers to train heads on"),
            "features": ("labkit.training.features", "the target's features of those answers"),
            "medusa": ("labkit.training.train_medusa", "Medusa-1 heads"),
            "eagle": ("labkit.training.train_eagle", "an EAGLE or EAGLE-3 head (--kind)"),
            "data-curve": ("labkit.training.data_curve", "heads trained on growing data, replayed"),
            "mtp": ("labkit.training.train_mtp", "a multi-token model from a config")}
POLICIES = ("fixed", "heuristic", "best-rate", "cost-aware")
DRAFT_PRECISIONS = ("auto", "fp32", "bf16", "int8", "int4")


def count_or_word(text: str, unit: str, words: dict):
    """A count >= 1 of `unit`, or one of `words` (name -> value): the parser of --draft-window and --draft-vocab."""
    if text in words:
        return words[text]
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"takes a number of {unit} >= 1, {' or '.join(map(repr, words))}, "
                                         f"got {text!r}")
    return value


def draft_window(text: str) -> int | str | None:
    """--draft-window: a number of tokens, 'all' for the whole context (None), or 'auto' (see resolve_window)."""
    return count_or_word(text, "tokens", {"all": None, "auto": "auto"})


def draft_vocab(text: str) -> int | str | None:
    """--draft-vocab: a number of token ids, 'auto' (drafters.vocab.auto_vocab) or 'all' (None)."""
    return count_or_word(text, "token ids", {"auto": "auto", "all": None})


def resolve_vocab(vocab: int | str | None, device: str, loop: str) -> int | str | None:
    """--draft-vocab on the compiled loops: the whole vocabulary (their draft scores every id)."""
    return None if compiled_bound(device, loop) else vocab


def compiled_bound(device: str, loop: str) -> bool:
    """Whether requests will run on the compiled loops: asked for, or chosen by default on a GPU."""
    from .models.checks import check_load_args
    return loop == "compiled" or (loop == "auto" and check_load_args("bf16", "auto", device)[0] == "cuda")


def concrete_dtype(a) -> str:
    """--dtype with auto resolved for the device (bf16, or fp16 on a GPU without bf16), as a bench run's key names it."""
    from .models.checks import check_load_args, resolve_dtype
    return resolve_dtype(a.dtype, check_load_args(a.dtype, a.backend, a.device)[0])


def resolve_window(window: int | str | None, device: str, loop: str) -> int | str | None:
    """--draft-window auto: the whole context where the compiled loops run (their draft reads it all, and a GPU
    reads a long prompt in one fast prefill); on the eager loop "auto" stays, chosen per prompt from this machine's
    costs (drafters/window.py: the whole context where the draft reads it cheaply, DEFAULT_WINDOW tokens else)."""
    if window != "auto":
        return window
    return None if compiled_bound(device, loop) else "auto"


def add_model_args(p, default_dtype: str = "auto") -> None:
    """--target, --draft, --dtype, --backend, --device, --draft-precision, --loop: shared by generate and bench."""
    from .decoding.loops import LOOPS
    from .models.checks import BACKENDS, DEVICES
    from .models.hub import DEFAULT_DRAFT, DEFAULT_TARGET
    p.add_argument("--target", default=DEFAULT_TARGET, help="preset, local directory or Hub id")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model for the draft-model methods")
    p.add_argument("--dtype", default=default_dtype, choices=["auto", "bf16", "fp32", "fp16", "int8", "int4"],
                   help="the target's precision (auto: bf16, or fp16 on a GPU without bf16 arithmetic; int8/int4: "
                        "labkit's quantized model on a CPU, a model of its own whose plain decoding speculation "
                        "reproduces)")
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="forward path: auto = the fastest this machine measured (cached), or force one")
    p.add_argument("--device", default="auto", choices=DEVICES,
                   help="auto: $LABKIT_DEVICE where it is set, else CUDA when a GPU is present")
    p.add_argument("--draft-window", type=draft_window, default="auto", metavar="N|all|auto",
                   help=f"tokens of the context the draft model reads besides its first 4 ('all': the whole context; "
                        f"auto: all on the compiled loop; on the eager one all where this machine's draft reads "
                        f"the prompt cheaply enough for the answer's length, else {DEFAULT_WINDOW}); the target "
                        "always reads everything, so the output is the same")
    p.add_argument("--draft-vocab", type=draft_vocab, default="auto", metavar="N|auto|all",
                   help=f"token ids the draft model scores: the N most frequent (data/vocab/) and the prompt's own, "
                        f"its LM head cut to them for a cheaper step, or 'all'. auto: {DEFAULT_VOCAB} where a ranking "
                        "is shipped for the draft's tokenizer, else all; all on the compiled loop. The target "
                        "verifies every token, so the output is the same")
    p.add_argument("--loop", default="auto", choices=LOOPS,
                   help="auto: the compiled loop on a GPU (static caches, torch.compile, CUDA graphs) where it takes "
                        "the request, else the eager one; eager: the readable reference loops; compiled: force it")
    p.add_argument("--draft-precision", default="auto", choices=DRAFT_PRECISIONS,
                   help="the draft model's weights: auto = the fastest one-token forward here (int8/int4 are "
                        "weight-only: the target still decides every token)")


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m labkit", description="labkit: speculative decoding, measured")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="decode one prompt, showing accepted / rejected / bonus tokens")
    g.add_argument("--prompt", help="the prompt text (or use --prompt-file)")
    g.add_argument("--prompt-file", help="read the prompt from this file ('-' for stdin)")
    g.add_argument("--drafter", choices=DRAFTERS, default="draft", help="none = plain autoregressive decoding")
    g.add_argument("--method", default=None, metavar="NAME",
                   help="run one of the bench's methods instead of --drafter (greedy): any drafter, tree or head "
                        "(suffix, lookahead, medusa, eagle3-tree, ...); `python -m labkit methods` lists them")
    g.add_argument("--gamma", type=int, default=5, help="draft tokens per step (the start value when adaptive)")
    g.add_argument("--policy", choices=POLICIES, default="fixed", help="how gamma changes during the run")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--seed", type=int, default=0, help="seed for sampling")
    add_model_args(g)
    g.add_argument("--max-seq-len", type=int, default=4096, help="context to allocate the KV cache for")
    g.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of coloured text")
    ms = sub.add_parser("models", help="list the embedded model presets and whether they are on disk")
    ms.add_argument("--calibration", action="store_true",
                    help="show the forward paths this machine chose (the calibration cache) and their timings")
    ms.add_argument("--recalibrate", action="store_true",
                    help="time the forward paths of every cached choice of this machine again (on a quiet machine)")
    sub.add_parser("methods", help="list every method `generate --method` and `bench --methods` run")
    t = sub.add_parser("train", help="train a drafter (the target's answers, features, heads, multi-token models); "
                                     "`train WHAT --help` for its options")
    t.add_argument("what", choices=TRAINERS, help="what to run: " + "; ".join(f"{k}: {v[1]}" for k, v in
                                                                            TRAINERS.items()))
    t.add_argument("args", nargs=argparse.REMAINDER, help="its own options")
    m = sub.add_parser("measure", help="run one of the checkout's measurement scripts (scripts/NAME.py, which write "
                                       "data/bench/); `measure --list` names them, `measure NAME --help` its options")
    m.add_argument("what", nargs="?", help="the script's name, e.g. roofline, bench_heads, layer_skip_search")
    m.add_argument("--list", action="store_true", help="list the measurement scripts and what each measures")
    m.add_argument("args", nargs=argparse.REMAINDER, help="its own options")
    f = sub.add_parser("fetch", help="download, verify and convert presets (all when none named)")
    f.add_argument("names", nargs="*")
    add_bench_parser(sub)
    add_verify_cost_parser(sub)
    ex = sub.add_parser("export", help="write a head trained here in a serving engine's format, and print the "
                                       "engine's command line")
    ex.add_argument("head", help="the head's directory, or a shipped head's name (data/heads/)")
    ex.add_argument("--format", required=True, choices=EXPORT_FORMATS,
                    help="; ".join(f"{k}: {v}" for k, v in EXPORT_FORMATS.items()))
    ex.add_argument("--out", required=True, help="the directory to write (the engine loads it as it is)")
    ex.add_argument("--target", default=None,
                    help="the target the head was trained on (default: the head's own base model, a preset)")
    ac = sub.add_parser("acceptance", help="a vLLM server's speculative-decoding counters (a saved /metrics page) "
                                           "in the lab's words: mean acceptance length, per position, α, best γ")
    ac.add_argument("metrics", help="the saved page: curl http://HOST:8000/metrics > metrics.txt")
    ac.add_argument("--since", default=None, metavar="EARLIER",
                    help="an earlier page of the same server: count only what happened between the two")
    ac.add_argument("--model", default=None, help="the served model's name, where the page counts several")
    ac.add_argument("--draft-cost", type=float, default=None, metavar="C",
                    help="one draft step over one target step: adds the speedup calculator's expected speedup at "
                         "the measured α for γ = 1..8 (flat verify)")
    ac.add_argument("--plot", default=None, metavar="PNG", help="draw the accept lengths and per-position rates")
    ac.add_argument("--json", action="store_true", help="one JSON object on stdout")
    bk = sub.add_parser("book", help="the notebooks with their stored outputs as a static site (what `make book` "
                                     "runs): open build/book/index.html, no kernel, no network")
    bk.add_argument("--out", default=None, help="the folder to write (default: build/book in the checkout)")
    lab = sub.add_parser("lab", help="JupyterLab on the notebooks (what `make lab` runs)")
    lab.add_argument("--ip", default=None, help="the address to serve on (default: LAB_IP, else 127.0.0.1)")
    lab.add_argument("--port", type=int, default=None, help="default: LAB_PORT, else 8888")
    lab.add_argument("--remote", action="store_true",
                     help="allow an address other machines can reach, such as 0.0.0.0 (or set LAB_REMOTE=1)")
    return ap


def add_verify_cost_parser(sub) -> None:
    from .models.backends import PATHS
    from .models.hub import DEFAULT_TARGET
    v = sub.add_parser("verify-cost", help="forward time vs tokens per forward on every path and precision here")
    v.add_argument("--model", default=DEFAULT_TARGET, help="preset, local directory or Hub id (labkit's model)")
    v.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, from: {','.join(PATHS)}")
    v.add_argument("--precisions", default="bf16,fp32", help="comma-separated, from: fp32,bf16,int8,int4")
    v.add_argument("--tokens", default="1,2,4,8,16,32,64", help="tokens per forward to time, comma-separated")
    v.add_argument("--context", type=int, default=256, help="cached tokens before each timed forward")
    v.add_argument("--repeats", type=int, default=5, help="timed runs per point (the best counts)")
    v.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    v.add_argument("--out", default="data/bench", help="verify_cost_<cpu>_<isa>.{json,md,png} go here")
    v.add_argument("--llama-cpp", action="store_true",
                   help="add llama.cpp's curve on the preset's GGUF (llama-bench; needs `make llama-cpp`)")


def add_bench_parser(sub) -> None:
    from .bench.methods import METHODS, VARIANTS
    b = sub.add_parser("bench", help="Spec-Bench-style run of every method on a question file (resumable)")
    b.add_argument("--questions", default=None,
                   help="Spec-Bench jsonl: question_id, category, turns (--report-only: checked against the run's)")
    b.add_argument("--methods", default=None, help=f"comma-separated, from: {','.join(METHODS)} (default: all that "
                   "run on the target; medusa and eagle-* need the embedded target their heads were trained on)")
    b.add_argument("--variant", default=None, metavar="NAMES",
                   help=f"comma-separated ablations, from: {','.join(VARIANTS)}, each run beside the chosen methods "
                   "it varies as METHOD-VARIANT (`python -m labkit methods` lists them)")
    b.add_argument("--categories", default=None, help="comma-separated categories to run (default: all)")
    b.add_argument("--limit", type=int, default=None, help="the first N questions only (after --categories)")
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--gamma", type=int, default=4, help="draft tokens per step (the start value when adaptive)")
    b.add_argument("--lookup-tokens", type=int, default=10, help="transformers' prompt_lookup_num_tokens")
    b.add_argument("--layer-skip-tokens", type=int, default=CALIBRATION_TOKENS, metavar="N",
                   help="calibration tokens the layer-skip search reads (its cost grows with them; >= 16)")
    add_model_args(b)
    b.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="torch threads (1 can be much faster when other jobs share the cores)")
    b.add_argument("--no-chat-template", action="store_true", help="feed each first turn as raw text")
    b.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="run each question's methods N rounds back to back; the fastest run of each counts (a rerun "
                   "with a larger N adds the missing rounds)")
    b.add_argument("--out", default="bench_out", help="results.jsonl, tables and plots go here")
    b.add_argument("--note", default="", help="a sentence for the report's header (what else ran, say)")
    b.add_argument("--report-only", action="store_true",
                   help="write the report of the latest run in --out from what is finished; run nothing")
    b.add_argument("--report-out", default=None, metavar="DIR",
                   help="with --report-only: write the report here instead of into --out")
    existing = b.add_mutually_exclusive_group()
    existing.add_argument("--append", action="store_true",
                          help="where --out holds a run with other settings, add this run beside it (the report "
                               "shows this run); without it such an --out is refused")
    existing.add_argument("--force", action="store_true",
                          help="where --out holds a run with other settings, delete its results and start afresh")
    b.add_argument("--skip-damaged", action="store_true",
                   help="with --report-only: leave out damaged lines of results.jsonl instead of stopping at the first")




def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt text from --prompt, or --prompt-file (a file, or '-' for stdin)."""
    from .files.textfile import MAX_BYTES, read_text
    if prompt is not None and prompt_file is not None:
        raise ValueError("give either --prompt or --prompt-file, not both")
    if prompt_file == "-":
        where = "stdin (--prompt-file -)"
        try:
            data = sys.stdin.buffer.read(MAX_BYTES + 1)
            if len(data) > MAX_BYTES:
                raise ValueError(f"{where} holds more than {MAX_BYTES >> 20} MiB: give the text of a prompt")
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{where} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    elif prompt_file is not None:
        where, text = f"--prompt-file {prompt_file}", read_text(prompt_file, "--prompt-file")
    else:
        where, text = "--prompt", prompt or ""
    if not text.strip():
        raise ValueError(f"the prompt is empty ({where}): pass --prompt \"...\" or --prompt-file FILE")
    return text


def make_drafter(kind: str, draft_model=None, eos_token_ids=(), window: int | str | None = None, target_model=None,
                 max_new_tokens: int = 64, vocab: int | None = None):
    """The drafter of --drafter (eos_token_ids: the draft stops drafting at them; () where the compiled loop runs,
    whose draft drafts every token; window "auto": weighed against target_model's step, measured when a prompt first
    outgrows the window, for answers of max_new_tokens)."""
    from .drafters import DraftModelDrafter, PromptLookupDrafter
    from .drafters.draft_model import draft_reading
    from .drafters.window import AutoWindow, WindowCosts
    if kind == "lookup":
        return PromptLookupDrafter()
    if window == "auto":
        window = AutoWindow(partial(WindowCosts.measure, target_model, draft_model), max_new_tokens, DEFAULT_WINDOW)
    return DraftModelDrafter(draft_reading(draft_model, window, vocab, always=tuple(eos_token_ids)),
                             eos_token_ids=eos_token_ids)


def make_policy(name: str, gamma: int, compiled: bool = False, drafter=None):
    """The --policy's γ policy; on the compiled loop an adaptive one drafts at most the verify's MAX_GAMMA tokens.
    The cost-aware one has `drafter` propose unverified on its plain steps where the eager loop runs."""
    from .core.adaptive import BestRateGamma, FixedGamma, HeuristicGamma
    from .tuning import CostAwareGamma, Shadowed
    if name == "fixed":
        return FixedGamma(gamma)
    from .decoding.compiled import MAX_GAMMA
    policy = {"heuristic": HeuristicGamma, "best-rate": BestRateGamma, "cost-aware": CostAwareGamma}[name]
    chosen = policy(gamma, max_gamma=MAX_GAMMA) if compiled else policy(gamma)
    return Shadowed(chosen, drafter) if name == "cost-aware" and drafter is not None and not compiled else chosen


def cmd_generate(a) -> int:
    from .core.sampling import SamplingConfig
    from .decoding.base import check_seed
    from .decoding.loops import decode
    from .models.checks import check_models
    from .models.loading import encode_prompt, load_draft, load_model
    sampling = SamplingConfig(a.temperature, a.top_k, a.top_p)
    policy = make_policy(a.policy, a.gamma, compiled_bound(a.device, a.loop))
    if a.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    if a.max_seq_len < 2:
        raise ValueError(f"--max-seq-len must be >= 2, got {a.max_seq_len}")
    try:
        check_seed(a.seed)
    except ValueError:
        raise ValueError(f"--seed must be an integer in [0, 2**63), got {a.seed}") from None
    text = read_prompt(a.prompt, a.prompt_file)
    if a.method is not None:
        return generate_method(a, text)
    check_models(a.target, a.dtype, a.backend, a.device, a.draft if a.drafter == "draft" else None, a.draft_precision)
    target = load_model(a.target, a.dtype, a.backend, a.max_seq_len, a.device, progress=not a.json)
    prompt = encode_prompt(target.tokenizer, text or "", not a.no_chat_template)
    draft, drafter = None, None
    if a.drafter != "none":
        if a.drafter == "draft":
            draft = load_draft(a.draft, target, a.draft_precision, a.backend, a.max_seq_len, progress=not a.json)
        compiled = compiled_bound(a.device, a.loop)
        drafter = make_drafter(a.drafter, draft.model if draft else None, () if compiled else target.eos_token_ids,
                               resolve_window(a.draft_window, a.device, a.loop), target.model, a.max_new_tokens,
                               resolve_vocab(a.draft_vocab, a.device, a.loop))
        policy = make_policy(a.policy, a.gamma, compiled, drafter)
    out, (loop, why) = decode(target.model, drafter, prompt, a.max_new_tokens, policy, sampling,
                              target.eos_token_ids, a.seed, loop=a.loop)
    show(a, out, target, draft, prompt, f"{loop} loop ({why})", {"drafter": a.drafter, "gamma": a.gamma,
                                                                 "policy": a.policy, "loop": {"loop": loop, "why": why}})
    choices = speed_choices(drafter)
    if choices and not a.json:
        print(f"[speed choices] {'; '.join(choices)}. The tokens are the same without them: --draft-window all "
              "--draft-vocab all decode with the textbook draft (the whole context, every token id).", file=sys.stderr)
    return 0


def speed_choices(drafter) -> list[str]:
    """What a draft-model drafter does beyond the textbook's draft, in words (empty for the others)."""
    reading = getattr(drafter, "reading", None)               # a draft model's (drafters/reading.py)
    return [] if reading is None else reading.choices()


def show(a, out, target, draft, prompt, loop: str, settings: dict) -> None:
    """A generation on stdout (coloured tokens, or one JSON object with --json), its stats on stderr."""
    from .models.calibrate import run_facts
    from .viz.render import committed_text, pieces, to_ansi
    text_out = target.tokenizer.decode(out.tokens, skip_special_tokens=True)
    ran = run_facts(target, draft)
    if a.json:
        print(json.dumps({"text": text_out, "tokens": out.tokens, "prompt_tokens": prompt.tolist(), **settings,
                          "ran_on": ran, "stats": out.trace.summary(), "steps": out.trace.to_dict()["steps"]}))
        return
    print(to_ansi(committed_text(pieces(out.trace, prompt.tolist(), target.tokenizer), out.trace),
                  colour=sys.stdout.isatty()))
    s = out.trace.summary()
    print(f"\n[{s['method']}] {s['new_tokens']} tokens in {s['total_time']:.2f}s ({s['tokens_per_second']:.1f} tok/s), "
          f"{s['target_forwards']} target forwards, {s['tokens_per_forward']:.2f} tokens/forward (bonus included), "
          f"acceptance {s['acceptance_rate']:.2f}" + _engine_words(s) + f", stop: {s['stop_reason']}",
          file=sys.stderr)
    print(f"[ran on] {ran['cpu']} ({ran['isa']}), {ran['threads']} threads; target: {ran['target']}"
          + (f"; draft: {ran['draft']}" if draft else "") + f"; {loop}", file=sys.stderr)


def _engine_words(summary: dict) -> str:
    """Mean acceptance length and the per-position acceptance rate, as vLLM, SGLang and llama.cpp report them."""
    if not summary["acceptance_per_position"]:
        return ""
    rates = ", ".join(f"{r:.2f}" for r in summary["acceptance_per_position"][:8])
    return (f"; mean acceptance length {summary['mean_acceptance_length']:.2f}, "
            f"per-position acceptance [{rates}{', ...' if len(summary['acceptance_per_position']) > 8 else ''}]")


def generate_method(a, text: str) -> int:
    """generate --method NAME: one of the bench's methods (bench.methods.METHODS, the one table of them) on one
    prompt, greedy, with the bench's settings; labkit's methods are drawn as --drafter's are, a peer's text printed."""
    import time

    from .bench.methods import method as registered
    from .bench.runner import BenchConfig, load_models
    from .models.loading import encode_prompt, load_model
    if a.temperature != 0:
        raise ValueError(f"--method runs the bench's methods, which decode greedily: use --temperature 0, or "
                         f"--drafter for sampling (got --temperature {a.temperature})")
    dtype = concrete_dtype(a)
    config = BenchConfig("", "", [a.method], a.target, a.draft, dtype, a.max_new_tokens, a.gamma,
                         backend=a.backend, device=a.device, draft_precision=a.draft_precision,
                         draft_window=resolve_window(a.draft_window, a.device, a.loop), loop=a.loop,
                         draft_vocab=resolve_vocab(a.draft_vocab, a.device, a.loop),
                         chat_template=not a.no_chat_template)
    method = registered(a.method)                # checked by BenchConfig (which adds the baseline to its list)
    target = load_model(a.target, dtype, a.backend, a.max_seq_len, a.device, progress=not a.json)
    models = load_models(config, progress=not a.json, target=target)
    prompt = encode_prompt(target.tokenizer, text or "", not a.no_chat_template)
    t0 = time.perf_counter()
    result = method.build(models, a.max_new_tokens, a.gamma, config.lookup_tokens)(prompt)
    seconds = result.seconds or time.perf_counter() - t0
    settings = {"method": method.name, "label": method.label.format(gamma=a.gamma, lookup_tokens=config.lookup_tokens)}
    if result.generation is not None:
        loop = "compiled" if result.generation.trace.method.startswith("compiled") else "eager"
        show(a, result.generation, target, models.draft, prompt, f"{loop} loop; method {settings['label']}",
             settings)
        return 0
    text_out = target.tokenizer.decode(result.tokens, skip_special_tokens=True)      # a peer: no trace to draw
    if a.json:
        print(json.dumps({"text": text_out, "tokens": result.tokens, "prompt_tokens": prompt.tolist(), **settings,
                          "seconds": seconds}))
    else:
        print(text_out)
        print(f"\n[{settings['label']}] {len(result.tokens)} tokens in {seconds:.2f}s "
              f"({len(result.tokens) / seconds:.1f} tok/s)", file=sys.stderr)
    return 0


def cmd_train(a) -> int:
    """train WHAT ARGS...: the module's own main, with its own options."""
    import importlib
    program, sys.argv[0] = sys.argv[0], f"python -m labkit train {a.what}"     # what its own --help calls it
    try:
        importlib.import_module(TRAINERS[a.what][0]).main(a.args)
    finally:
        sys.argv[0] = program
    return 0


def measurements() -> dict[str, Path]:
    """The checkout's measurement scripts, scripts/NAME.py, by NAME (they are not part of an installed package)."""
    from .files.shipped import CHECKOUT
    folder = CHECKOUT / "scripts"
    if not folder.is_dir():
        raise ValueError(f"the measurement scripts live in a checkout's scripts/ folder, and {folder} is not there: "
                         "clone the repository and run `python -m labkit measure` from it")
    return {p.stem: p for p in sorted(folder.glob("*.py"))}


def cmd_measure(a) -> int:
    """measure NAME ARGS...: scripts/NAME.py as `python scripts/NAME.py ARGS...` runs it; --list: every script."""
    import ast
    import runpy
    scripts = measurements()
    if a.list or not a.what:
        for name, path in scripts.items():
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            print(f"{name:28s} {doc.splitlines()[0] if doc else ''}")
        return 0
    if a.what not in scripts:
        raise ValueError(f"no measurement script {a.what!r}: choose one of {', '.join(scripts)} "
                         "(`python -m labkit measure --list` says what each measures)")
    argv = sys.argv
    sys.argv = [f"python -m labkit measure {a.what}", *a.args]      # what the script's own argparse reads
    try:
        runpy.run_path(str(scripts[a.what]), run_name="__main__")
    finally:
        sys.argv = argv
    return 0


def cmd_methods(a) -> int:
    from .bench.methods import METHODS, VARIANTS
    for name, m in METHODS.items():
        needs = f" (needs: {', '.join(sorted(m.needs))})" if m.needs else ""
        print(f"{name:24s} {m.label.format(gamma='γ', lookup_tokens='n')}{needs}")
    print("variants: bench --variant NAME runs METHOD-NAME beside each method it varies (generate --method "
          "METHOD-NAME runs one)")
    for name, v in VARIANTS.items():
        print(f"{name:24s} {v.label}: {', '.join(v.of)}")
    return 0




def cmd_models(a) -> int:
    from .models.hub import PRESETS, status
    if a.calibration or a.recalibrate:
        return show_calibration(a.recalibrate)
    for name, spec in PRESETS.items():
        state, _, problem = status(name).partition(": ")
        print(f"{name:32s} {state:12s} {spec.hf_id}")
        if problem:
            print(f"    {state}: {problem}: `python -m labkit fetch {name}` checks and repairs it")
    return 0


def show_calibration(again: bool) -> int:
    """models --calibration / --recalibrate: each cached choice with the times it was made from."""
    from .models import calibrate
    if again:
        if not (remeasured := calibrate.recalibrate()):
            print("no cached choice of this machine to measure again: the first load of a model times its paths")
        for choice in remeasured:
            print(f"measured again: {calibrate.describe(choice)}")
        print()
    choices = calibrate.cached_choices()
    here = calibrate.machine()
    print(f"calibration cache: {calibrate.cache_file()} ({len(choices)} entries, "
          f"{sum(c.machine == here for c in choices.values())} of this machine)")
    for key, c in choices.items():
        shape = key.split("|")[-2] if key.count("|") >= 2 else "?"
        others = "not read" if c.others_cpu is None else f"{c.others_cpu:.2f} cores"
        print(f"\n{c.precision} {shape}: the {c.path} path" + ("" if c.machine == here else " (another machine)"))
        print(f"    {c.machine.get('cpu')} [{calibrate.isa_label(c.machine)}], {c.machine.get('threads')} threads, "
              f"torch {c.machine.get('torch')}; {c.measured_at}, other processes {others}, {c.rounds} round(s)")
        beaten = calibrate.dominated(c.times)
        for path, t in c.times.items():
            mark = "  <- chosen" if path == c.path else "  (beaten at every size)" if path in beaten else ""
            print(f"    {path:11s} " + "  ".join(f"t({T}) {t[T] * 1e3:7.1f} ms" for T in t) +
                  f"  t(8)/t(1) {t['8'] / t['1']:.2f}{mark}")
    return 0


def cmd_fetch(a) -> int:
    from .models.hub import DEFAULT_DRAFT, DEFAULT_TARGET, fetch, preset_spec
    names = a.names or [DEFAULT_TARGET, DEFAULT_DRAFT]
    for name in names:
        preset_spec(name)                               # every name checked before anything downloads
    for name in names:
        folder, done = fetch(name)
        print(f"{name}: {done}, {folder}")
    return 0


def cmd_bench(a) -> int:
    from .bench import BenchConfig, run_bench, write_report
    if a.report_only:
        return bench_report(a)
    if a.questions is None:
        raise ValueError("--questions is needed to run the benchmark: a Spec-Bench jsonl, such as "
                         "data/questions/labkit_bench.jsonl (or --report-only to write the report of a finished run)")
    if a.report_out is not None or a.skip_damaged:
        raise ValueError("--report-out and --skip-damaged go with --report-only (a run writes its report into --out "
                         "and refuses damaged results)")

    def split(s):
        return None if s is None else [x.strip() for x in s.split(",") if x.strip()]
    dtype = concrete_dtype(a)                                                         # a run's key names it
    config = BenchConfig(a.questions, a.out, split(a.methods), a.target, a.draft, dtype, a.max_new_tokens,
                         a.gamma, a.lookup_tokens, a.threads, not a.no_chat_template, split(a.categories), a.limit,
                         a.backend, a.device, a.draft_precision, resolve_window(a.draft_window, a.device, a.loop),
                         a.loop, a.layer_skip_tokens, a.repeats, resolve_vocab(a.draft_vocab, a.device, a.loop),
                         split(a.variant) or [])
    existing = "append" if a.append else "replace" if a.force else "refuse"
    try:
        results = run_bench(config, existing=existing)
    except KeyboardInterrupt:
        print(f"\ninterrupted: finished questions are kept in {a.out}; rerun the same command to go on",
              file=sys.stderr)
        return 130
    for path in write_report(results, config.run_key, a.note):
        print(path)
    return 0


def bench_report(a) -> int:
    """bench --report-only: the report of the latest run in --out (into --report-out where given); --questions, where
    given, must be the run's."""
    from .bench import write_report
    from .bench.questions import read_questions
    from .bench.runner import RESULTS, latest_meta, question_set
    results = Path(a.out) / RESULTS
    if not results.is_file():
        raise ValueError(f"--out {a.out} holds no benchmark run ({results} is not there): run `python -m labkit "
                         "bench` first, or point --out at a benchmark's folder")
    meta = latest_meta(results, a.skip_damaged)
    if a.questions is not None and meta is not None:
        asked = question_set(a.questions, read_questions(a.questions, meta.get("categories"), meta.get("limit")))
        there = meta.get("question_set") or {"file": Path(str(meta.get("questions", ""))).name}
        if asked["file"] != there["file"] or there.get("sha", asked["sha"]) != asked["sha"]:
            raise ValueError(f"--questions {a.questions} is not the question set of the run in --out {a.out} "
                             f"({there['file']}): drop --questions, or give that run's file")
    for path in write_report(results, None, a.note, out=a.report_out, skip_damaged=a.skip_damaged):
        print(path)
    return 0


def cmd_verify_cost(a) -> int:
    from .bench import verify_cost
    from .files.textfile import writable_dir
    from .models.backends import PATHS, check_path
    paths = [p.strip() for p in a.paths.split(",") if p.strip()]
    if not paths:
        raise ValueError(f"--paths names no path: choose one or more of {','.join(PATHS)} (comma-separated)")
    precisions = verify_cost.check_precisions([p.strip() for p in a.precisions.split(",") if p.strip()])
    for p in paths:
        if p not in PATHS:
            check_path(p, "bf16")                       # the error names the paths there are
    try:
        tokens = tuple(sorted({int(t) for t in a.tokens.split(",")}))
    except ValueError:
        raise ValueError(f"--tokens takes comma-separated integers, got {a.tokens!r}") from None
    if not tokens or tokens[0] < 1 or a.context < 1 or a.repeats < 1 or a.threads < 1:
        raise ValueError("--tokens, --context, --repeats and --threads must be >= 1")
    if a.llama_cpp:
        from .bench import llama_cpp
        llama_cpp.check_model(a.model)
        llama_cpp.check_available((llama_cpp.BENCH,))
    from .models.hub import resolve_model
    resolve_model(a.model)                              # a bad name fails here, before any bar or measurement
    writable_dir(a.out, "--out")
    torch.set_num_threads(a.threads)
    result = verify_cost.measure(a.model, paths, precisions, tokens, a.context, a.repeats)
    if a.llama_cpp:
        result = verify_cost.add_llama_cpp(result, a.model)
    print(verify_cost.markdown(result))
    for path in verify_cost.write(result, a.out):
        print(path)
    return 0


EXPORT_FORMATS = {"speculators": "an EAGLE-3 head as vLLM serves it (speculators' Eagle3DraftModel: vllm serve DIR)",
                  "specforge": "an EAGLE-3 head as SGLang and SpecForge read it (LlamaForCausalLMEagle3, midlayer.*)",
                  "llama-cpp": "an EAGLE-3 head as llama.cpp runs it (a GGUF from llama.cpp's own converter: "
                               "--spec-type draft-eagle3; needs `make llama-cpp-src`)",
                  "vllm-medusa": "Medusa-1 heads as vLLM's Medusa model (one residual layer per head and the "
                                 "target's LM head, shared)"}


def cmd_export(a) -> int:
    from .export.vllm_medusa import export_vllm_medusa, medusa_config
    from .files.shipped import shipped
    from .models.hub import resolve_model
    head = Path(a.head)
    if not head.is_dir() and (shipped("heads", must_exist=False) / a.head).is_dir():
        head = shipped("heads", must_exist=False) / a.head
    if not (head / "config.json").is_file():
        raise ValueError(f"{a.head} is no head directory (config.json + model.safetensors) and no shipped head; the "
                         f"shipped ones: {', '.join(sorted(p.name for p in shipped('heads').iterdir() if p.is_dir()))}")
    if a.format == "vllm-medusa":
        meta = medusa_config(head)                 # before the target is fetched for a head it cannot export
    else:
        meta = json.loads((head / "config.json").read_text())
        if meta.get("kind") != "eagle3":
            raise ValueError(f"{head} holds {meta.get('kind') or 'Medusa'} heads: the {a.format} format carries "
                             "EAGLE-3 heads (the shipped one: eagle3-qwen2.5-coder-1.5b); Medusa heads export as "
                             "vllm-medusa")
    if a.format == "llama-cpp":
        from .export.llama_cpp import check_converter
        check_converter()                          # before the target is fetched
    base = a.target or meta.get("base_model")
    if not base:
        raise ValueError(f"{head}/config.json names no base model: give --target")
    target = resolve_model(base)
    if a.format == "vllm-medusa":
        out = export_vllm_medusa(head, target, a.out)
        print(f"wrote {out} ({meta['n_heads']} Medusa heads on {base}'s LM head). Serve it with vLLM:")
        config = json.dumps({"method": "medusa", "model": str(out), "num_speculative_tokens": meta["n_heads"]})
        print(f"  vllm serve {target} --speculative-config '{config}'")
        return 0
    steps = meta.get("ttt_steps") or 5
    if a.format == "llama-cpp":
        from .export.llama_cpp import command_line, export_llama_cpp
        from .models.hub import PRESETS, fetch_weights
        gguf = export_llama_cpp(head, target, a.out, steps=steps)
        print(f"wrote {gguf} (an EAGLE-3 head on {base}, by llama.cpp's convert_hf_to_gguf.py). Run it with llama.cpp "
              "(make llama-cpp builds llama-speculative-simple):")
        target_gguf = fetch_weights(base, progress=False) if base in PRESETS else f"{base}.gguf"
        print(f"  {command_line(target_gguf, gguf, steps + 1)}")     # as deep as labkit's chain (eagle3-chain)
        return 0
    from .export.eagle3 import export_eagle3
    out = export_eagle3(head, target, a.out, a.format, steps)
    print(f"wrote {out} (an EAGLE-3 head on {base}, blocks {meta.get('layers')}, {meta.get('draft_vocab_size'):,} "
          "draft tokens).")
    if a.format == "speculators":
        print(f"Serve it with vLLM (the verifier is named in its config: {target}):")
        print(f"  vllm serve {out}")
        config = json.dumps({"method": "eagle3", "model": str(out), "num_speculative_tokens": steps})
        print(f"  or: vllm serve {target} --speculative-config '{config}'")
    else:
        print("Serve it with SGLang:")
        print(f"  python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
              f"--speculative-draft-model-path {out} --speculative-num-steps {steps} --speculative-eagle-topk 8 "
              "--speculative-num-draft-tokens 32")
    return 0


def cmd_acceptance(a) -> int:
    from .bench.vllm_metrics import read_vllm_metrics
    if a.draft_cost is not None and not (a.draft_cost >= 0 and math.isfinite(a.draft_cost)):
        raise ValueError(f"--draft-cost is a ratio of step times, >= 0: got {a.draft_cost}")
    counts = read_vllm_metrics(a.metrics, a.model, "metrics")
    if a.since:
        counts = counts - read_vllm_metrics(a.since, a.model, "--since")
    if not counts.drafts:
        raise ValueError(f"{a.metrics} counts no draft" + (" since the earlier page" if a.since else "")
                         + ": was the server decoding with --speculative-config?")
    out = {**counts.as_dict(), "gamma": counts.gamma, "draft_acceptance_rate": counts.draft_acceptance_rate,
           "judged_alpha": counts.judged_alpha}
    if a.draft_cost is not None:
        from .viz.calculator import best_gamma, chain_speedup
        out["expected_speedup"] = {g: chain_speedup(counts.judged_alpha, g, a.draft_cost) for g in range(1, 9)}
        out["best_gamma"] = best_gamma(counts.judged_alpha, a.draft_cost, max_gamma=8)
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from .viz.acceptance import plot_acceptance
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
        plot_acceptance(counts, axes, label=Path(a.metrics).name)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
        plt.close(fig)
    if a.json:
        print(json.dumps(out))
        return 0
    rates = ", ".join(f"{r:.2f}" for r in out["acceptance_per_position"])
    print(f"{counts.drafts:,} drafts of up to {counts.gamma} tokens: {counts.accepted_tokens:,} of "
          f"{counts.draft_tokens:,} draft tokens accepted (draft acceptance rate {counts.draft_acceptance_rate:.2f})")
    print(f"mean acceptance length {counts.mean_acceptance_length:.2f} (the bonus token included); "
          f"per-position acceptance [{rates}]")
    model = ", ".join(f"{counts.judged_alpha ** (i + 1):.2f}" for i in range(counts.gamma))
    print(f"α = {counts.judged_alpha:.2f} (accepted / judged draft tokens); the i.i.d. model's per-position rates "
          f"at that α: [{model}]")
    if a.draft_cost is not None:
        speedups = ", ".join(f"γ={g}: {x:.2f}x" for g, x in out["expected_speedup"].items())
        print(f"expected speedup at c = {a.draft_cost:g}, flat verify: {speedups}; best γ = {out['best_gamma']}")
    if a.plot:
        print(a.plot)
    return 0


def cmd_book(a) -> int:
    from pathlib import Path

    from .book import build_book
    root = Path(__file__).resolve().parent.parent
    pages = build_book(root, Path(a.out) if a.out else None)
    print(f"{len(pages) - 2} chapters and a glossary in {pages[0].parent}: open {pages[0]} (or python -m http.server "
          f"-d {pages[0].parent})")
    return 0


def cmd_lab(a) -> int:
    from pathlib import Path

    from .lab import run_lab
    return run_lab(a.ip, a.port, Path(__file__).resolve().parent.parent, a.remote)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line on stderr (exit code 2) that points at --help."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def main(argv: list[str] | None = None) -> int:
    from .models.hub import ModelFetchError
    a = build_parser().parse_args(argv)
    try:
        return {"generate": cmd_generate, "models": cmd_models, "methods": cmd_methods, "fetch": cmd_fetch,
                "bench": cmd_bench, "verify-cost": cmd_verify_cost, "lab": cmd_lab, "book": cmd_book,
                "train": cmd_train, "measure": cmd_measure, "acceptance": cmd_acceptance,
                "export": cmd_export}[a.command](a)
    except (ValueError, ModelFetchError, NotImplementedError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
