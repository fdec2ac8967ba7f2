"""The first cell of every notebook: the machine its numbers were measured on, and its cost story.

Every speed in a notebook is true only on the machine that ran it, so each notebook opens by
measuring that machine: the CPU, its vector ISA and matrix units, the threads, the load average
(other work on the machine slows every timing), the target's forward path and precision, and the
one ratio every speculative speedup rests on,

    t(8) / t(1): a forward over 8 new tokens against a forward over 1.

When it is near 1 a verify pass of several draft tokens costs about one plain step and the
speedup approaches the tokens committed per forward; when it is 3 a step must commit 3 tokens
only to break even. The facts travel with the cell's output (metadata "labkit.machine"), where
the stored-notebook test reads them.

    from labkit.viz.machine import this_machine
    facts = this_machine(target)          # measures (a few seconds) and displays the table
    facts.verify_ratio                    # t(8) / t(1)

`speed_table` displays a table of runs and checks that no speedup exceeds its tokens per forward
times the slack: a speculative step costs at least one target forward, so a larger ratio means a
noisy or wrong timing, never a result, and the table says so under it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..models import calibrate
from ..models.transformer import weight_bytes

QUIET = 0.25            # cores busy with other processes above this slow every 2-thread timing
SLACK = 1.05            # a speedup may exceed tokens per forward by timer noise, no more


@dataclass
class MachineFacts:
    """What the notebook's timings depend on, measured when the notebook ran."""
    cpu: str
    isa: str
    threads: int
    torch: str
    load: list[float]            # 1-, 5-, 15-minute load averages (this process's model loading included)
    others_cpu: float | None     # cores other processes kept busy over one second, just before timing
    model: str
    path: str                    # the forward path the model runs (labkit.models.backends)
    precision: str
    t1_ms: float                 # one forward over 1 new token after 64 cached ones
    t8_ms: float                 # ... over 8 new tokens
    weight_gb: float
    noise: float = 0.0           # how far the timed repeats of t(1) and t(8) spread: median over best, the larger

    @property
    def verify_ratio(self) -> float:
        """t(8) / t(1): what a verify pass of 8 tokens costs in plain steps."""
        return self.t8_ms / self.t1_ms

    @property
    def bandwidth_gbs(self) -> float:
        """The weights streamed per second by a one-token forward (GB/s): a lower bound on memory bandwidth."""
        return self.weight_gb / (self.t1_ms / 1e3)

    @property
    def quiet(self) -> bool:
        return self.others_cpu is not None and self.others_cpu <= QUIET

    def to_dict(self) -> dict:
        return {**asdict(self), "verify_ratio": round(self.verify_ratio, 3),
                "bandwidth_gbs": round(self.bandwidth_gbs, 2), "quiet": self.quiet}

    def story(self) -> str:
        """What t(8)/t(1) means for every speedup in the notebook, in words that follow its value and its noise."""
        r, noise = self.verify_ratio, self.noise
        lead = f"A forward over 8 tokens costs {r:.2f} forwards over 1 here"
        if r < 1 - noise:
            return (f"{lead}: less than one, by more than the timing noise (the repeats spread by {noise:.0%}). This "
                    "forward path's kernels are slower for one row than for several, so a verify pass can cost less "
                    "than a plain step, and a speculative run's speedup may exceed its tokens per forward by as much.")
        if r <= 1.2:                     # within 20% of a step: the drafting time, not the verify, sets the gain
            below = (f" (below 1 only within the timing noise: the repeats spread by {noise:.0%})" if r < 1 else "")
            return (f"{lead}{below}, so verifying a draft is nearly free: a speculative run's speedup approaches its "
                    "tokens per forward, less the drafting time.")
        return (f"{lead}, so a verify pass is not free: a run that commits 8 tokens per forward gains at most "
                f"{8 / r:.1f}x, and one that commits fewer than {r:.1f} loses time.")

    def markdown(self) -> str:
        load = ", ".join(f"{x:.2f}" for x in self.load)
        if self.others_cpu is None:
            state = "not measured here (no /proc): check that nothing else runs"
        elif self.quiet:
            state = f"{self.others_cpu:.2f} cores: quiet"
        else:
            state = f"{self.others_cpu:.2f} cores: busy, so every timing below is slower and noisier"
        rows = [("CPU", self.cpu), ("ISA", self.isa), ("threads", str(self.threads)), ("torch", self.torch),
                ("load average (1, 5, 15 min), this notebook's own work included", load),
                ("other processes' CPU use, just before timing", state),
                ("model timed", self.model), ("forward path, precision", f"{self.path}, {self.precision}"),
                ("t(1): forward over 1 token", f"{self.t1_ms:.1f} ms"),
                ("t(8): forward over 8 tokens", f"{self.t8_ms:.1f} ms"),
                ("t(8) / t(1)", f"{self.verify_ratio:.2f} (repeats spread by {self.noise:.0%})"),
                ("weights streamed per second at t(1)", f"{self.bandwidth_gbs:.1f} GB/s "
                                                        f"({self.weight_gb:.2f} GB / t(1))")]
        table = "\n".join(f"| {k} | {v} |" for k, v in rows)
        return f"**This machine**\n\n| | |\n|---|---|\n{table}\n\n{self.story()}"

    def _repr_markdown_(self) -> str:
        return self.markdown()


def measure_machine(loaded, context: int = 64, repeats: int = 3) -> MachineFacts:
    """Time `loaded` (a LoadedModel: load_model's result) for 1 and 8 new tokens and read the machine."""
    load, others = calibrate.load_average(), calibrate.others_cpu()    # before timing: the timing itself adds load
    runs = calibrate.time_forward_runs(loaded.model, context, (1, 8), repeats, progress=False)
    seconds = {T: min(r) for T, r in runs.items()}
    noise = max(sorted(r)[len(r) // 2] / min(r) - 1 for r in runs.values())
    m = calibrate.machine()
    return MachineFacts(cpu=m["cpu"], isa=calibrate.isa_label(m), threads=m["threads"], torch=m["torch"],
                        load=load, others_cpu=others,
                        model=loaded.name, path=loaded.path.name, precision=loaded.path.precision,
                        t1_ms=seconds[1] * 1e3, t8_ms=seconds[8] * 1e3, weight_gb=weight_bytes(loaded.model) / 1e9,
                        noise=noise)


def this_machine(loaded, context: int = 64, repeats: int = 3) -> MachineFacts:
    """Measure and display the machine facts (with metadata for the stored-notebook test); return them."""
    from IPython.display import Markdown, display
    facts = measure_machine(loaded, context, repeats)
    display(Markdown(facts.markdown()), metadata={"labkit": {"machine": facts.to_dict()}})
    return facts


@dataclass
class SpeedCheck:
    label: str
    speedup: float
    tokens_per_forward: float
    verify_floor: float = 1.0      # the least a verify forward costs in one-token forwards: min(1, t(8)/t(1))

    @property
    def consistent(self) -> bool:
        return self.speedup <= self.tokens_per_forward / self.verify_floor * SLACK


def inconsistent(rows: list[SpeedCheck]) -> str:
    """'' when every speedup is within its tokens per forward (times SLACK); otherwise what is wrong."""
    bad = [r for r in rows if not r.consistent]
    if not bad:
        return ""
    lines = "; ".join(f"{r.label}: {r.speedup:.2f}x at {r.tokens_per_forward:.2f} tokens per forward" for r in bad)
    return (f"**These timings contradict each other** ({lines}): a verify pass costs at least one target "
            "forward (on this machine at least t(8)/t(1) of one, from the first cell), so no speedup can exceed "
            "the tokens committed per forward. The baseline was timed slow, most likely on a busy machine: check "
            "the first cell's CPU use and run the notebook again.")


def speed_table(df, speedup: str = "speedup", tokens_per_forward: str = "tokens / forward", digits: int = 2,
                facts: MachineFacts | None = None):
    """Display a table of runs (a pandas DataFrame, one row per run) with its speedups checked.

    A speedup above its tokens per forward (beyond timer noise) is flagged under the table, never
    hidden. Where `facts` measured a forward over 8 tokens cheaper than one over 1 (some CPU kernels
    are slower for one row than for several), a verify pass may cost less than a plain step, and the
    bound is raised by that factor. Rows without a tokens-per-forward value (no speculation) are not
    checked. The checked pairs go with the output as metadata ("labkit.speed"), where the
    stored-notebook test checks them.
    """
    from IPython.display import Markdown, display
    floor = min(1.0, facts.verify_ratio) if facts is not None else 1.0
    rows = [SpeedCheck(str(label), float(row[speedup]), float(row[tokens_per_forward]), floor)
            for label, row in df.iterrows() if row[tokens_per_forward] == row[tokens_per_forward]]   # skip NaN
    display(df.round(digits), metadata={"labkit": {"speed": [asdict(r) for r in rows]}})
    if problem := inconsistent(rows):
        display(Markdown(problem))
