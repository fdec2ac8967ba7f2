"""Results -> tables and plots: per method and category, everything relative to the same run's baseline.

Definitions (the Markdown header repeats them):
- tokens/s: new tokens over wall seconds, prefill included, summed over the questions.
- speedup: a method's tokens/s over the baseline's tokens/s on the same questions.
- tokens per target forward: new tokens over target forward passes; each pass commits its
  accepted draft tokens plus one token of the target's (the bonus or correction token).
- acceptance rate: accepted draft tokens over proposed draft tokens.
- mean acceptance length, per-position acceptance: as vLLM, SGLang and llama.cpp report them, over the
  steps that drafted: 1 + accepted draft tokens per such step, and per draft position i the share of
  those steps that kept their i-th draft token (core/engine_counts.py).
- draft / verify share: seconds drafting / inside target forwards, over wall seconds.
- ideal speedup: Leviathan et al.'s improvement factor for the acceptance, γ and step costs
  measured in this run (draft and verify steps in units of the baseline's decode step). Tree
  methods have no single acceptance rate: their ideal is the tree analogue, the new tokens
  over the measured drafting and verify seconds of every step, in baseline decode steps (what
  the method would reach if nothing but its forwards and its drafting took time). Over several
  questions: the baseline's seconds over the seconds each question would take at its ideal
  speedup (a ratio of sums, as the measured speedup is).
- oracle: per question the fastest of labkit's methods (autoregressive included), what a perfect
  method chooser would reach; its tokens/s is the new tokens over the sum of those fastest seconds.
- prefill share: seconds spent reading the prompt (before the first decode step) over wall seconds;
  decode speedup: new tokens over the seconds after the prefill, against the baseline's. A question
  whose answer is 17 tokens after 741 of prompt is mostly prefill, which no drafter shortens: the
  decode speedup says what speculation did with the part it can change.
- paired speedup (runs in rounds): per round, the method's tokens/s over the baseline's in that same
  round, over the category's questions; the median over the rounds, with the lowest and highest. The
  speedup above counts each pair's fastest run, so one run of the baseline in a fast minute of a
  shared machine sets a category; a round's two runs are minutes apart at most, so such a minute
  moves both sides of that round's ratio, or one round of several.
"""
from __future__ import annotations

import csv
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from ..core.adaptive import expected_speedup
from ..core.engine_counts import count_drafts
from ..files.textfile import writable_dir
from .methods import BASELINE, known, run_order
from .methods import method as registered
from .records import read_results
from .runner import best_runs

ALL = "all"
ORACLE = "oracle"


@dataclass
class Row:
    category: str
    method: str
    label: str
    questions: int
    tokens_per_second: float
    speedup: float
    tokens_per_forward: float | None
    acceptance_rate: float | None
    draft_share: float | None
    verify_share: float
    ideal_speedup: float | None
    same_as_baseline: int          # questions whose tokens equal labkit's autoregressive output
    same_as_reference: int         # ... equal the plain decoder of the method's own stack
    speedup_over_reference: float | None = None   # tok/s over the plain decoder of its own stack (None: absent)
    prefill_share: float | None = None             # prefill seconds / wall seconds (None: not measured)
    decode_speedup: float | None = None            # decode-phase tok/s over the baseline's decode-phase tok/s
    paired_speedup: float | None = None            # median over rounds of the round's speedup (None: one round)
    paired_low: float | None = None                # the lowest round's speedup
    paired_high: float | None = None               # the highest round's
    mean_acceptance_length: float | None = None    # 1 + accepted per drafting step, as vLLM counts (None: no drafts)
    acceptance_per_position: list[float] | None = None   # [i]: drafting steps that kept draft token i / such steps


@dataclass
class Mismatch:
    question_id: str
    category: str
    method: str
    reference: str
    first_difference: int          # index of the first new token where the outputs part


def first_difference(tokens: list[int], reference: list[int]) -> int | None:
    """Index of the first token where two outputs part (None when equal)."""
    if tokens == reference:
        return None
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


def ideal_speedup(steps: list[list] | None, baseline_steps: list[list], tree: bool = False) -> float | None:
    """Leviathan's speedup for this run's measured acceptance rate and costs (γ = mean draft length); for a tree
    method, tokens committed per baseline step's worth of its measured drafting and verifying."""
    drafted = [s for s in steps or [] if s[0] > 0]
    ar_step = statistics.median(s[4] for s in (baseline_steps[:-1] or baseline_steps))
    if not drafted or ar_step <= 0:
        return None
    if tree:                                   # per step [nodes, accepted, bonus, draft s, verify s]
        committed = sum(s[1] + 1 for s in steps)
        return committed * ar_step / sum(s[3] + s[4] for s in steps)
    accepted = sum(s[1] for s in drafted)
    rejections = sum(1 - s[2] for s in drafted)
    alpha = accepted / max(1, accepted + rejections)
    gamma = max(1, round(statistics.mean(s[0] for s in drafted)))
    draft_cost = sum(s[3] for s in drafted) / sum(s[0] for s in drafted) / ar_step
    verify_cost = statistics.mean(s[4] for s in drafted) / ar_step
    return expected_speedup(alpha, gamma, draft_cost, verify_cost)


@dataclass(frozen=True)
class Paired:
    """A method's speedup paired within rounds: the median over the rounds and the lowest and highest round."""
    median: float
    low: float
    high: float
    rounds: int


def paired_speedup(rs: list[dict], base: list[dict]) -> Paired | None:
    """Per round, the method's tokens/s over the baseline's on the same questions in that round; the median over
    the rounds every question of both ran (None: fewer than two such rounds, or records without rounds)."""
    if not all("rounds" in r for r in rs + base):
        return None
    common = set.intersection(*(set(r["rounds"]) for r in rs + base))
    ratios = [_round_tps(rs, k) / _round_tps(base, k) for k in sorted(common)]
    if len(ratios) < 2:
        return None
    return Paired(statistics.median(ratios), min(ratios), max(ratios), len(ratios))


def _round_tps(records: list[dict], k: int) -> float:
    """New tokens over seconds of the records' runs in round k."""
    return sum(r["rounds"][k][0] for r in records) / sum(r["rounds"][k][1] for r in records)


def repeat_spread(records: list[dict]) -> dict:
    """How far apart the repeats of one (question, method) were: the median and the largest slowest / fastest
    seconds over the pairs timed more than once ({} when none was)."""
    spreads = sorted(max(r["seconds_runs"]) / min(r["seconds_runs"]) for r in records if r.get("runs", 1) > 1)
    if not spreads:
        return {}
    return {"repeat_spread": {"median": spreads[len(spreads) // 2], "max": spreads[-1], "pairs": len(spreads)}}


def load_run(path: str | Path, run_key: str | None = None, skip_damaged: bool = False) -> tuple[dict, list[dict]]:
    """(meta, records) of one run in a results file: `run_key`'s, or the latest run's; one record per (question,
    method), its fastest repeat (runner.best_runs)."""
    records = read_results(Path(path), skip_damaged)
    metas = [r for r in records if "meta" in r]
    if not metas:
        raise ValueError(f"{path} holds no benchmark run: run `python -m labkit bench` first")
    run_key = run_key or metas[-1]["run"]
    meta = next((m["meta"] for m in reversed(metas) if m["run"] == run_key), None)
    if meta is None:
        raise ValueError(f"{path} holds no run {run_key!r}")
    return meta, best_runs([r for r in records if r.get("run") == run_key and "method" in r])


def run_methods(records: list[dict]) -> list[str]:
    """The methods in a run's records, in registry order (unknown names last)."""
    present = list(dict.fromkeys(r["method"] for r in records))
    return sorted(filter(known, present), key=run_order) + [m for m in present if not known(m)]


def complete_questions(records: list[dict]) -> list[str]:
    """Questions every method of the run has finished, in run order."""
    done = {(r["question_id"], r["method"]) for r in records}
    methods = run_methods(records)
    return [q for q in dict.fromkeys(r["question_id"] for r in records) if all((q, m) in done for m in methods)]


def aggregate(records: list[dict], labels: dict[str, str] | None = None) -> tuple[list[Row], list[Mismatch]]:
    """Per (category, method) rows, `all` categories last, and every output that parts from its reference.

    Only questions every method finished count (a run cut short leaves some half done), so all
    rows of a category compare the same questions.
    """
    by = {(r["question_id"], r["method"]): r for r in records}
    methods = run_methods(records)
    questions = complete_questions(records)
    category = {q: by[q, BASELINE]["category"] for q in questions}
    mismatches = []
    for q in questions:
        for m in methods:
            if (q, m) not in by or not by[q, m]["exact"]:
                continue
            for ref in dict.fromkeys([BASELINE, by[q, m]["reference"]]):
                d = first_difference(by[q, m]["tokens"], by[q, ref]["tokens"]) if (q, ref) in by else None
                if d is not None:
                    mismatches.append(Mismatch(q, category[q], m, ref, d))
    rows = []
    for cat in sorted(set(category.values())) + [ALL]:
        qs = [q for q in questions if cat in (ALL, category[q])]
        for m in methods:
            if qs:
                ref = by[qs[0], m]["reference"]
                row = _row(cat, m, (labels or {}).get(m, m), [by[q, m] for q in qs],
                           [by[q, BASELINE] for q in qs], mismatches)
                if ref in methods:
                    row.speedup_over_reference = row.tokens_per_second / _tps([by[q, ref] for q in qs])
                rows.append(row)
        own = _own_methods(by, questions, methods)
        if qs and len(own) > 1:
            rows.append(_oracle_row(cat, [[by[q, m] for m in own] for q in qs], [by[q, BASELINE] for q in qs],
                                    mismatches))
    return rows, mismatches


def _own_methods(by: dict, questions: list[str], methods: list[str]) -> list[str]:
    """The methods of labkit's own stack (their reference is labkit autoregressive): the oracle's choice."""
    return [m for m in methods if by[questions[0], m]["reference"] == BASELINE] if questions else []


def _fastest(records: list[dict]) -> dict:
    return max(records, key=lambda r: r["new_tokens"] / r["seconds"])


def oracle_picks(records: list[dict]) -> dict[str, int]:
    """How many questions each labkit method is the fastest on (the oracle's choices), most first."""
    by = {(r["question_id"], r["method"]): r for r in records}
    questions = complete_questions(records)
    own = _own_methods(by, questions, run_methods(records))
    picks = [_fastest([by[q, m] for m in own])["method"] for q in questions]
    return dict(sorted(((m, picks.count(m)) for m in set(picks)), key=lambda x: -x[1]))


def _oracle_row(cat: str, per_question: list[list[dict]], base: list[dict], mismatches: list[Mismatch]) -> Row:
    """Per question the fastest of labkit's methods: the speed of a perfect method chooser."""
    best = [_fastest(rs) for rs in per_question]                                 # one record a question
    parted = {(x.question_id, x.method) for x in mismatches if x.reference == BASELINE}
    same = sum((r["question_id"], r["method"]) not in parted for r in best)
    prefill, decode, base_decode = _prefill(best), _decode_tps(best), _decode_tps(base)
    seconds = sum(r["seconds"] for r in best)
    return Row(cat, ORACLE, "oracle: the fastest labkit method per question", len(best), _tps(best),
               _tps(best) / _tps(base), None, None, None, sum(r["verify_time"] for r in best) / seconds,
               None, same, same, prefill_share=None if prefill is None else prefill / seconds,
               decode_speedup=decode / base_decode if decode and base_decode else None)


def _tps(records: list[dict]) -> float:
    return sum(x["new_tokens"] for x in records) / sum(x["seconds"] for x in records)


def _prefill(records: list[dict]) -> float | None:
    """Prefill seconds summed over the records (None when one of them did not measure it)."""
    values = [r.get("prefill_seconds") for r in records]
    return None if any(v is None for v in values) else sum(values)


def _decode_tps(records: list[dict]) -> float | None:
    """New tokens over the seconds after the prefill (None where the prefill was not measured)."""
    prefill = _prefill(records)
    decode = None if prefill is None else sum(r["seconds"] for r in records) - prefill
    return sum(r["new_tokens"] for r in records) / decode if decode else None


def _row(cat: str, method: str, label: str, rs: list[dict], base: list[dict], mismatches: list[Mismatch]) -> Row:
    seconds = sum(r["seconds"] for r in rs)
    drafted = [s for r in rs for s in r["steps"] or [] if s[0] > 0]
    proposed = sum(s[0] for s in drafted)
    forwards = sum(r["target_forwards"] for r in rs)
    tree = known(method) and registered(method).tree
    counts = count_drafts([(s[0], s[1]) for s in drafted], tree)
    # per question, the baseline's seconds and the ideal speedup; over questions a ratio of sums, as × AR is
    ideals = [(b["seconds"], i) for r, b in zip(rs, base)
              if (i := ideal_speedup(r["steps"], b["steps"] or [], tree)) is not None]
    parted = {(x.question_id, x.reference) for x in mismatches if x.method == method}
    prefill, decode, base_decode = _prefill(rs), _decode_tps(rs), _decode_tps(base)
    paired = paired_speedup(rs, base)
    return Row(cat, method, label, len(rs), _tps(rs), _tps(rs) / _tps(base),
               sum(r["new_tokens"] for r in rs) / forwards if forwards else None,
               sum(s[1] for s in drafted) / proposed if proposed else None,
               sum(r["draft_time"] for r in rs) / seconds if all(r["draft_time"] is not None for r in rs) else None,
               sum(r["verify_time"] for r in rs) / seconds,
               sum(t for t, _ in ideals) / sum(t / i for t, i in ideals) if ideals else None,
               sum((r["question_id"], BASELINE) not in parted for r in rs),
               sum((r["question_id"], r["reference"]) not in parted for r in rs),
               prefill_share=None if prefill is None else prefill / seconds,
               decode_speedup=decode / base_decode if decode and base_decode else None,
               paired_speedup=paired and paired.median, paired_low=paired and paired.low,
               paired_high=paired and paired.high,
               mean_acceptance_length=counts.mean_acceptance_length if counts.drafts else None,
               acceptance_per_position=counts.as_dict()["acceptance_per_position"] if counts.drafts else None)


def gates(records: list[dict], labels: dict[str, str] | None = None) -> dict[str, dict[str, int]]:
    """Per gated method (its label): how many of the counted runs drafted, how many of those paid, how many ran
    plain ({} where no method is gated)."""
    out: dict[str, dict[str, int]] = {}
    for r in records:
        if r.get("gate"):
            n = out.setdefault((labels or {}).get(r["method"], r["method"]), {"drafted": 0, "paid": 0, "plain": 0})
            n["drafted" if r["gate"]["drafted"] else "plain"] += 1
            n["paid"] += bool(r["gate"].get("paid"))
    return out


def gate_counts(per_method: dict[str, dict[str, int]]) -> str:
    return "; ".join(f"{label} drafted {n['drafted']} questions ({n['paid']} of them paid) and ran {n['plain']} plain"
                     for label, n in per_method.items())


def _spread_sentence(meta: dict) -> str:
    spread = meta.get("repeat_spread")
    if not spread:
        return ""
    return (f" (the slowest of a pair's runs took {spread['median'] - 1:.0%} longer than its fastest in the median "
            f"pair, {spread['max'] - 1:.0%} at the most)")


def _fmt(x, spec: str = "{:.2f}") -> str:
    return "–" if x is None else spec.format(x)


def _paired(row: Row) -> str:
    """The paired speedup with its lowest and highest round ("–" for a run of one round, and the oracle)."""
    if row.paired_speedup is None:
        return "–"
    return f"{row.paired_speedup:.2f} ({row.paired_low:.2f}-{row.paired_high:.2f})"


def _ran_on(meta: dict) -> str:
    """The forward paths and the machine's load, where the run recorded them."""
    facts = meta.get("ran_on")
    if not facts:
        return ""
    draft = f"; draft model: {facts['draft']}" if facts.get("draft") else ""
    load = meta.get("load_average_at_start")
    peers = any(m.startswith("hf-") for m in meta.get("methods", ["hf-"]))     # older runs: the peers ran
    return (f"labkit's target ran the {facts['target']}{draft}"
            + (f"; transformers' peers run their own stock kernels in {meta['dtype']}" if peers else "") + ". "
            + (f"Load average at the start: {load[0]:.2f}. " if load else ""))


def _window_sentence(meta: dict) -> str:
    """How much of the context the draft model read (older runs: all of it, or a fixed window)."""
    window = meta.get("draft_window")
    if window == "auto":
        rule = meta.get("window_rule")
        return f"; {rule['describe']}" if rule else ""
    return f"; the draft model reads the context's first 4 tokens and its last {window}" if window else ""


def _vocab_sentence(meta: dict) -> str:
    """Which ids the draft model scored (older runs: all of them)."""
    vocab = meta.get("draft_vocab")
    if vocab == "auto":
        vocab = meta.get("draft_vocab_auto")
    return (f"; the draft model scores the {vocab:,} most frequent token ids and the prompt's own "
            "(its LM head cut to them)" if vocab else "") + _opening_sentence(meta)


def _opening_sentence(meta: dict) -> str:
    """Whether the draft model copied in the chat template's opening instead of reading it (older runs: not)."""
    n = meta.get("draft_opening_tokens")
    return (f"; it reads the chat template's first {n} tokens once and copies their keys and values into each "
            "prompt's cache" if n else "")


def _per_position(rows: list[Row], shown: int = 8) -> list[str]:
    """The per-position acceptance rate of each drafting method over all questions, as vLLM logs it."""
    drafting = [r for r in rows if r.category == ALL and r.acceptance_per_position]
    if not drafting:
        return []
    n = min(shown, max(len(r.acceptance_per_position) for r in drafting))
    cut = any(len(r.acceptance_per_position) > n for r in drafting)
    cells = lambda rates: [f"{x:.2f}" for x in rates[:n]] + ["–"] * (n - len(rates[:n]))     # noqa: E731
    return ["", "Per-position acceptance over all questions, as vLLM logs it: for draft position i, the share of the "
            "steps that drafted whose i-th draft token was accepted (unconditional: it falls as α^i under the "
            "i.i.d. model; the mean acceptance length is 1 + the sum over every position"
            + (f"; the first {n} positions" if cut else "") + ").", "",
            "| method | acc. len | " + " | ".join(f"pos {i + 1}" for i in range(n)) + " |",
            "|---|---|" + "---|" * n] + [f"| {r.label} | {r.mean_acceptance_length:.2f} | "
                                         + " | ".join(cells(r.acceptance_per_position)) + " |" for r in drafting]


def summarise(meta: dict, rows: list[Row], mismatches: list[Mismatch], note: str = "") -> str:
    """The Markdown report: settings and definitions, the table, and every output that parts from its reference."""
    lines = [f"# labkit bench: {Path(meta['questions']).name}", "",
             f"Measured {meta['date']} on {meta['machine']}; target `{meta['target']}`, draft `{meta['draft']}`, "
             f"{meta['dtype']}, greedy, max_new_tokens={meta['max_new_tokens']}, γ={meta['gamma']}"
             + _window_sentence(meta) + _vocab_sentence(meta) + ". "
             + _ran_on(meta) + "Every ratio compares methods run back to back on the same question"
             + (", in an order rotated from one question to the next (no method always runs first)"
                if meta.get("method_order") == "rotated" else "")
             + (", which cancels slow drift, not bursts." if meta.get("repeats", 1) == 1 else
                f"; each ran {meta['repeats']} times in rounds back to back and the fastest run counts, which "
                "cancels slow drift and a burst that slowed one run" + _spread_sentence(meta) + ".")
             + (f" {note}" if note else ""), "",
             "Definitions: *tok/s* = new tokens / wall seconds (prefill included; for llama.cpp its own clocks, "
             "which leave out its process start and model load), summed over the questions; "
             "*× AR* = tok/s over labkit autoregressive's on the same questions; *× own* = tok/s over the plain "
             "decoder of the method's own stack (labkit's, transformers' generate, llama.cpp's); *tok/fwd* = new tokens / target "
             "forward passes (each pass commits its accepted draft tokens plus the target's own bonus or correction "
             "token); *accept* = accepted / proposed draft tokens; *acc. len* = mean acceptance length as vLLM, "
             "SGLang and llama.cpp report it: 1 + accepted draft tokens per step that drafted (the bonus or "
             "correction token included; steps that drafted nothing are left out, where *tok/fwd* counts them); "
             "*draft*, *verify* = shares of wall time spent "
             "drafting and in target forwards; *ideal ×* = Leviathan et al.'s speedup for this run's measured "
             "acceptance and step costs (tree methods: new tokens per baseline step's worth of their measured "
             "drafting and verifying; over several questions a ratio of sums, as *× AR*); *= AR* / *= ref* = questions whose output equals labkit autoregressive's / "
             "the plain decoder of the method's own stack (transformers generate for the peers) token for token; "
             "*prefill* = share of wall time spent reading the prompt, before the first decode step; *× AR decode* = "
             "new tokens over the seconds after the prefill, against labkit autoregressive's (what speculation "
             "changed: no drafter shortens the prefill)"
             + ("; *× AR paired* = per round, tok/s over labkit autoregressive's in the same round, the median over "
                "the rounds (the lowest and highest round in brackets): a fast or slow minute of the machine moves "
                "both runs of a round, where it can set *× AR*'s fastest run alone" if meta.get("repeats", 1) > 1
                else "") + ".", "",
             "| category | method | n | tok/s | × AR | × AR paired | × AR decode | prefill | × own | tok/fwd | acc. len "
             "| accept | draft | verify | ideal × | = AR | = ref |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.category} | {r.label} | {r.questions} | {r.tokens_per_second:.2f} | {r.speedup:.2f} | "
                     f"{_paired(r)} | {_fmt(r.decode_speedup)} | {_fmt(r.prefill_share, '{:.0%}')} | "
                     f"{_fmt(r.speedup_over_reference)} | "
                     f"{_fmt(r.tokens_per_forward)} | {_fmt(r.mean_acceptance_length)} | {_fmt(r.acceptance_rate)} | "
                     f"{_fmt(r.draft_share, '{:.0%}')} | "
                     f"{r.verify_share:.0%} | {_fmt(r.ideal_speedup)} | {r.same_as_baseline}/{r.questions} | "
                     f"{r.same_as_reference}/{r.questions} |")
    lines += _per_position(rows)
    picks = meta.get("oracle_picks")
    if picks:
        lines += ["", "The oracle row takes, per question, the fastest of labkit's methods (autoregressive included): "
                  "what a perfect method chooser would reach. Its choices: "
                  + ", ".join(f"{m} {n}" for m, n in picks.items()) + "."]
    gated = gate_counts(meta.get("gates", {}))
    if gated:
        lines += ["", "A gated method drafts a question only where drafting paid on the last drafted question of its "
                  "category in the same round, the draft's reading of the prompt counted, and decodes the others plain "
                  "(`labkit/tuning/gate.py`). Of the runs counted here: " + gated + "."]
    lines += ["", "## Outputs that part from their reference", ""]
    if not mismatches:
        lines.append("None: every method's output equals its reference token for token on every question.")
    else:
        lines += ["Greedy decoding is exact in exact arithmetic, so these are rounding, not bugs, when the dtype is "
                  "bf16: a k-token verify forward (and another library's kernels; llama.cpp multiplies Q4_K weights "
                  "by 8-bit quantised activations) rounds differently from a 1-token forward, so a near-tie between the top two tokens can flip, and the outputs part from there "
                  "(the fp32 tests show token-for-token equality).", "",
                  "| question | category | method | reference | first different token |", "|---|---|---|---|---|"]
        lines += [f"| {x.question_id} | {x.category} | {x.method} | {x.reference} | {x.first_difference} |"
                  for x in mismatches]
    return "\n".join(lines) + "\n"


def write_report(results: str | Path, run_key: str | None = None, note: str = "", out: str | Path | None = None,
                 skip_damaged: bool = False) -> list[Path]:
    """bench.md, bench.csv, bench.json and the plots beside the results file (or in `out`); returns their paths.

    `note`: a sentence for the Markdown header (what else ran on the machine, say).
    """
    results = Path(results)
    meta, records = load_run(results, run_key, skip_damaged)
    rows, mismatches = aggregate(records, meta.get("labels"))
    meta = {**meta, "oracle_picks": oracle_picks(records), **repeat_spread(records)}
    counts = gates(records, meta.get("labels"))
    if counts:
        meta["gates"] = counts
    out = results.parent if out is None else writable_dir(out, "--report-out")
    paths = [out / "bench.md", out / "bench.csv", out / "bench.json"]
    if not rows:
        raise ValueError(f"no question in {results} is finished by every method yet: run the benchmark on")
    paths[0].write_text(summarise(meta, rows, mismatches, note), encoding="utf-8")
    with paths[1].open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        w.writeheader()
        w.writerows(asdict(r) for r in rows)
    paths[2].write_text(json.dumps({"meta": meta, "note": note, "rows": [asdict(r) for r in rows],
                                    "mismatches": [asdict(x) for x in mismatches]}, indent=1), encoding="utf-8")
    from .plots import plot_accept_lengths, plot_speedups
    paths.append(plot_speedups(rows, out / "speedup_by_category.png"))
    complete = set(complete_questions(records))
    paths.append(plot_accept_lengths([r for r in records if r["question_id"] in complete], meta.get("labels") or {},
                                     out / "accept_lengths.png"))
    return paths
