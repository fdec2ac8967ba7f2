"""The resumable loop: for each question, every method in turn (an order rotated from question to question).

Each finished (question, method) is appended to `results.jsonl` at once and flushed, keyed by
a hash of the settings that change the numbers; a rerun with the same settings skips what is
there, so a crash or Ctrl-C loses no finished question. With `repeats` > 1 each question's methods
run that many rounds back to back and the report counts each pair's fastest run (`best_runs`): on a
shared machine a burst of load slows one run, not the pair's number. A rerun with more repeats adds
the missing rounds.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

from ..decoding.loops import LOOPS
from ..drafters.vocab import auto_vocab
from ..files.textfile import writable_dir
from ..models.layer_skip import CALIBRATION_TOKENS
from .methods import (
    CROSS_DRAFT,
    METHODS,
    Models,
    check_dtype,
    check_methods,
    check_target,
    default_methods,
    method,
    with_variants,
)
from .questions import Question, read_questions
from .records import RESULTS, append, read_results

WARM_UP_PROMPT, WARM_UP_TOKENS = "Say hi.", 8


@dataclass
class BenchConfig:
    questions: str
    out: str
    methods: list[str] | None = None   # None: every method that runs on the target (default_methods)
    target: str = "qwen2.5-coder-1.5b-instruct"
    draft: str = "qwen2.5-coder-0.5b-instruct"
    dtype: str = "bf16"
    max_new_tokens: int = 64
    gamma: int = 4
    lookup_tokens: int = 10            # transformers' prompt_lookup_num_tokens (its docs' value)
    threads: int = field(default_factory=torch.get_num_threads)
    chat_template: bool = True
    categories: list[str] | None = None
    limit: int | None = None
    backend: str = "auto"              # labkit's forward path (checks.BACKENDS); auto: calibrated
    device: str = "auto"
    draft_precision: str = "auto"      # the draft model's weights (loading.draft_precision)
    draft_window: int | str | None = "auto"  # tokens the draft model reads besides the sinks (None: all;
    #                                            "auto": all where this machine reads it cheaply, drafters/window.py)
    loop: str = "auto"                 # decoding.loops: auto = the compiled loop on a GPU, eager elsewhere
    layer_skip_tokens: int = CALIBRATION_TOKENS   # calibration tokens the layer-skip search reads
    repeats: int = 1                   # rounds of every method per question; the fastest run of each counts
    draft_vocab: int | str | None = "auto"   # ids the draft model scores: the k most frequent and the prompt's
    #                                          (None: all; "auto": drafters.vocab.auto_vocab)
    variants: list[str] = field(default_factory=list)   # ablations run beside the methods they vary (VARIANTS)

    def __post_init__(self):
        chosen = default_methods(self.target, self.dtype) if self.methods is None else self.methods
        self.methods = check_methods(with_variants(chosen, self.variants))
        check_target(self.methods, self.target)
        check_dtype(self.methods, self.dtype)
        for name in ("max_new_tokens", "gamma", "lookup_tokens", "threads", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.layer_skip_tokens < 16:
            raise ValueError(f"--layer-skip-tokens must be >= 16 (the search's calibration text), "
                             f"got {self.layer_skip_tokens}")
        if self.loop not in LOOPS:
            raise ValueError(f"--loop must be one of {', '.join(LOOPS)}, got {self.loop!r}")
        window = self.draft_window
        if window not in (None, "auto") and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"--draft-window must be a number of tokens >= 1, 'all' or 'auto', got {window!r}")
        vocab = self.draft_vocab
        if vocab not in (None, "auto") and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1):
            raise ValueError(f"--draft-vocab must be a number of token ids >= 1, 'auto' or 'all', got {vocab!r}")

    @property
    def run_key(self) -> str:
        """Hash of every setting that changes tokens or timings (not which questions or methods)."""
        keyed = {k: getattr(self, k) for k in ("target", "draft", "dtype", "max_new_tokens", "gamma",
                                               "lookup_tokens", "threads", "chat_template")}
        for k in ("backend", "device", "draft_precision"):     # keys of older runs stay valid at the defaults
            if getattr(self, k) != "auto":
                keyed[k] = getattr(self, k)
        if self.draft_window is not None:                       # older runs' drafts read the whole context
            keyed["draft_window"] = self.draft_window
        if self.loop != "auto":
            keyed["loop"] = self.loop
        if self.draft_vocab is not None:                        # older runs' drafts scored every id
            keyed["draft_vocab"] = self.draft_vocab
        if self.layer_skip_tokens != CALIBRATION_TOKENS:
            keyed["layer_skip_tokens"] = self.layer_skip_tokens
        return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:12]


def load_recorded_steps(results: str | Path, method: str, max_gamma: int | None = None,
                        category: str | tuple[str, ...] | None = None) -> list[tuple[int, int]]:
    """Every step (γ, n_accepted) of `method`'s runs in a benchmark's results.jsonl, question after question
    (only `category`'s questions, or those of any of several categories, when given).

    A step's record is [γ, n_accepted, bonus, draft s, verify s] (labkit.bench.runner); a tree method's γ is its
    node count. With `max_gamma`, longer drafts are cut to it (n_accepted too): what a verify of at most
    max_gamma draft tokens would have kept.
    """
    path = Path(results)
    if not path.is_file():
        raise ValueError(f"{path} does not exist: give a benchmark's results.jsonl, such as "
                         "data/bench/code_edit/results.jsonl")
    steps, methods = [], set()
    categories = None if category is None else {category} if isinstance(category, str) else set(category)
    for record in read_results(path):
        if "method" not in record:
            continue                                   # a run's meta line
        methods.add(record["method"])
        if record["method"] != method or not record.get("steps") or \
                (categories is not None and record.get("category") not in categories):
            continue
        recorded = json.loads(record["steps"]) if isinstance(record["steps"], str) else record["steps"]
        for gamma, n, *_ in recorded:
            cap = gamma if max_gamma is None else min(gamma, max_gamma)
            steps.append((int(cap), int(min(n, cap))))
    if not steps:
        raise ValueError(f"{path} holds no steps of method {method!r}" + (f" in category {category!r}" if category else "")
                         + f"; its methods: {sorted(methods)}")
    return steps


def done_pairs(records: list[dict], run_key: str) -> set[tuple[str, str, str, int]]:
    """(question_id, question sha, method, repeat) already measured under these settings."""
    return {(r["question_id"], r["question_sha"], r["method"], r.get("repeat", 0)) for r in records
            if r.get("run") == run_key and "method" in r}


def best_runs(records: list[dict]) -> list[dict]:
    """One record per (question, method): the fastest of its repeats (most new tokens a second), with `runs` (how
    many there were), `seconds_runs` (each one's seconds) and `rounds` ({round: (new tokens, seconds)}, for ratios
    paired within a round) beside it, in the order the pairs first appear."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        groups.setdefault((r["question_id"], r["method"]), []).append(r)
    return [{**max(rs, key=lambda r: r["new_tokens"] / r["seconds"]), "runs": len(rs),
             "seconds_runs": [r["seconds"] for r in rs],
             "rounds": {r.get("repeat", 0): (r["new_tokens"], r["seconds"]) for r in rs}} for rs in groups.values()]


def load_models(config: BenchConfig, progress: bool = True, target=None) -> Models:
    """labkit's pair, and transformers' copies of the checkpoints only when a chosen method needs them (`target`:
    the target, already loaded as the config says)."""
    from ..models.checks import DTYPES, check_models
    from ..models.hub import resolve_model
    from ..models.loading import load_draft, load_model
    needs = set().union(*(method(n).needs for n in config.methods))
    check_models(config.target, config.dtype, config.backend, config.device,
                 config.draft if "draft" in needs else None, config.draft_precision)
    if target is None:
        target = load_model(config.target, config.dtype, config.backend, device=config.device, progress=progress)
    models = Models(target, draft_name=config.draft, draft_window=config.draft_window,
                    draft_vocab=config.draft_vocab, loop=config.loop,
                    layer_skip_tokens=config.layer_skip_tokens, chat_template=config.chat_template)
    if "draft" in needs:
        models.draft = load_draft(config.draft, models.target, config.draft_precision, config.backend,
                                  progress=progress)
    if "cross_draft" in needs:
        models.cross_draft = load_model(CROSS_DRAFT, config.dtype, config.backend, device=config.device,
                                        progress=progress)
    if needs & {"hf", "hf_draft", "hf_cross"}:
        from transformers import AutoModelForCausalLM

        def hf(name):
            path = resolve_model(name, progress)
            return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[config.dtype]).eval()
        models.hf_target = hf(config.target)
        models.hf_draft = hf(config.draft) if "hf_draft" in needs else None
        models.hf_cross = hf(CROSS_DRAFT) if "hf_cross" in needs else None
    return models


def encode(models: Models, q: Question, chat_template: bool) -> torch.Tensor:
    from ..models.loading import encode_prompt
    return encode_prompt(models.target.tokenizer, q.messages if q.earlier else q.prompt, chat_template)   # (T,)


def output_dir(out: str | Path) -> Path:
    """The benchmark's output directory, created and checked writable before any model loads."""
    out = writable_dir(out, "--out")
    results = out / RESULTS
    if results.exists() and not results.is_file():
        raise ValueError(f"--out {out}: {results} is not a file: remove it or give another directory")
    return out


KEYED = ("target", "draft", "dtype", "max_new_tokens", "gamma", "lookup_tokens", "threads", "chat_template", "backend",
         "device", "draft_precision", "draft_window", "loop", "draft_vocab", "layer_skip_tokens")
EXISTING = ("refuse", "append", "replace")     # what a run does where --out holds a run with other settings


def question_set(questions_file: str | Path, questions: list[Question]) -> dict:
    """Which questions a run asks: the file's name, how many, and a hash of their ids and texts."""
    ids = "\n".join(f"{q.question_id}:{q.sha}" for q in questions)
    return {"file": Path(questions_file).name, "n": len(questions),
            "sha": hashlib.sha256(ids.encode()).hexdigest()[:12]}


def differences(meta: dict, config: BenchConfig, questions: list[Question]) -> list[str]:
    """How this run's settings differ from a recorded run's meta ([]: the same run, to resume or repeat)."""
    out = [f"{k} {meta.get(k)!r} there, {getattr(config, k)!r} here" for k in KEYED
           if k in meta and meta[k] != getattr(config, k)]
    if sorted(meta.get("methods") or []) != sorted(config.methods):
        out.append(f"methods {','.join(meta.get('methods') or [])} there, {','.join(config.methods)} here")
    asked = question_set(config.questions, questions)
    there = meta.get("question_set")
    if there is None:                              # a run recorded before question sets were: its file and selection
        there = {"file": Path(str(meta.get("questions", ""))).name}
        for k in ("categories", "limit"):
            if meta.get(k) != getattr(config, k):
                out.append(f"{k} {meta.get(k)!r} there, {getattr(config, k)!r} here")
    if there.get("file") != asked["file"] or there.get("sha", asked["sha"]) != asked["sha"]:
        n = f" ({there['n']} questions)" if "n" in there else ""
        out.append(f"questions {there.get('file')}{n} there, {asked['file']} ({asked['n']} questions) here")
    return out


def latest_meta(path: Path, skip_damaged: bool = False) -> dict | None:
    """The meta of the last run recorded in a results file (None: no run yet)."""
    metas = [r["meta"] for r in read_results(path, skip_damaged) if "meta" in r]
    return metas[-1] if metas else None


def check_existing(path: Path, config: BenchConfig, questions: list[Question], existing: str) -> None:
    """Refuse, before any model loads, a run whose settings differ from those of the run already in the folder,
    unless told to add it there (append) or to start the folder afresh (replace)."""
    if existing not in EXISTING:
        raise ValueError(f"existing must be one of {', '.join(EXISTING)}, got {existing!r}")
    meta = latest_meta(path)
    if meta is None or existing != "refuse" or not (diff := differences(meta, config, questions)):
        return
    raise ValueError(f"--out {path.parent} holds a run with other settings ({'; '.join(diff[:4])}"
                     f"{'; ...' if len(diff) > 4 else ''}): give another --out, or --append to add this run there "
                     "(its report then shows this run), or --force to replace the results there")


@contextmanager
def locked(out: Path):
    """Hold `out` for one bench at a time: a second bench on the same folder is refused at once."""
    lock = out / ".bench.lock"
    with lock.open("a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise ValueError(f"a bench is already running in --out {out} (pid {holder}): wait for it to finish, or "
                             "give this run another --out") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        finally:
            lock.unlink(missing_ok=True)


def run_bench(config: BenchConfig, models: Models | None = None, progress: bool = True,
              existing: str = "refuse") -> Path:
    """Run every pending (question, method) pair; returns the results file. Where the folder holds a run with
    other settings, `existing` says what to do: refuse (an error naming them), append, or replace."""
    questions = read_questions(config.questions, config.categories, config.limit)
    out = output_dir(config.out)
    path = out / RESULTS
    check_existing(path, config, questions, existing)
    with locked(out):
        if existing == "replace":
            path.unlink(missing_ok=True)
        done = done_pairs(read_results(path), config.run_key)
        todo = [(q, [(m, r) for r in range(config.repeats) for m in rotated(config.methods, i + r)
                     if (q.question_id, q.sha, m, r) not in done])
                for i, q in enumerate(questions)]
        todo = [(q, ms) for q, ms in todo if ms]
        if not todo:
            if progress:
                print(f"all {len(questions)} questions x {len(config.methods)} methods x {config.repeats} repeats "
                      f"already in {path}")
            return path
        threads_before = torch.get_num_threads()
        torch.set_num_threads(config.threads)
        try:
            _run_pending(config, questions, todo, path, models or load_models(config, progress), progress)
        finally:
            torch.set_num_threads(threads_before)
    return path


def _run_pending(config: BenchConfig, questions: list[Question], todo: list[tuple[Question, list[tuple[str, int]]]],
                 path: Path, models: Models, progress: bool) -> None:
    append(path, {"run": config.run_key, "meta": {**_meta(config, models),
                                                  "question_set": question_set(config.questions, questions)}})
    names = list(dict.fromkeys(m for _, ms in todo for m, _ in ms))
    warm_ids = encode(models, Question("warm-up", "warm-up", WARM_UP_PROMPT), config.chat_template)
    for name in tqdm(names, desc="warm-up", disable=not progress):      # first calls allocate; not timed
        method(name).build(models, WARM_UP_TOKENS, config.gamma, config.lookup_tokens)(warm_ids)
    runs = {name: method(name).build(models, config.max_new_tokens, config.gamma, config.lookup_tokens)
            for name in names}
    bar = tqdm(total=sum(len(ms) for _, ms in todo), desc="question x method", disable=not progress)
    for q, pending in todo:
        ids = encode(models, q, config.chat_template)
        for name, repeat in pending:
            bar.set_postfix_str(f"{q.question_id} {name}" + (f" ({repeat + 1}/{config.repeats})" if config.repeats > 1
                                                              else ""))
            m = method(name)
            t0 = time.perf_counter()
            result = runs[name](ids, workload=(q.category, repeat)) if m.per_workload else runs[name](ids)
            wall = time.perf_counter() - t0
            append(path, {"run": config.run_key, "question_id": q.question_id, "question_sha": q.sha,
                           "category": q.category, "method": name, "reference": m.reference, "exact": m.exact,
                           "prompt_tokens": ids.numel(), "new_tokens": len(result.tokens), "repeat": repeat,
                           **asdict(result), "seconds": wall if result.seconds is None else result.seconds})
            bar.update()
    bar.close()


def rotated(methods: list[str], i: int) -> list[str]:
    """The i-th question's order: the methods rotated by i, so that no method always runs first (or right after
    the same one) and a drift within a question's runs falls on every method alike."""
    k = i % len(methods) if methods else 0
    return methods[k:] + methods[:k]


def _meta(config: BenchConfig, models: Models) -> dict:
    from ..models.calibrate import run_facts
    facts = run_facts(models.target, models.draft)
    rule = {}
    if config.draft_vocab == "auto" and models.draft is not None:
        rule["draft_vocab_auto"] = None if models.compiled else auto_vocab(models.draft.model.vocab_size)
    if models.draft is not None:
        rule["draft_opening_tokens"] = 0 if models.opening is None else len(models.opening)
    if config.draft_window == "auto" and models.draft is not None:
        auto = models.window(config.max_new_tokens)
        rule["window_rule"] = {"describe": auto.describe(), "longest_whole_prompt": auto.longest_whole_prompt(),
                               **asdict(auto.costs)}
    return {**asdict(config), **rule, "method_order": "rotated",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{facts['cpu']} ({facts['isa']}), {platform.machine()}, {config.threads} threads, "
                       f"torch {torch.__version__}",
            "ran_on": facts, "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
            "labels": {n: method(n).label.format(gamma=config.gamma, lookup_tokens=config.lookup_tokens)
                       for n in dict.fromkeys([*METHODS, *config.methods])}}
