"""The stepper: one speculative step at a time, drawn.

For one target forward it shows the draft's proposal, the target's verdict on each drafted
token, the accepted prefix, the rejected suffix, the token the target adds, and the rollback
of both KV caches (their lengths before the step, at its peak and after the rollback). A
"next step" button takes the next step; a γ slider restarts the decode with another γ.
`take_step` and `step_html` are plain functions (tested without a browser); `Stepper` wires
them to ipywidgets.
"""
from __future__ import annotations

import html as _html
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

from ..core.trace import CacheLengths, Step
from ..decoding.speculative import SpeculativeDecoder
from .render import CSS, pieces, to_html


@dataclass(frozen=True)
class StepView:
    index: int                         # 0-based step (target forward) number
    context: list[int]                 # committed token ids before the step (prompt + generated)
    step: Step
    target_cache: CacheLengths
    draft_cache: CacheLengths | None   # None when the drafter keeps no cache (prompt lookup)


@contextmanager
def _peak_at_rollback(cache, seen: list[int]):
    """Record the cache's length each time it is truncated (the length just before the rollback)."""
    truncate = cache.truncate

    def watched(length: int) -> None:
        seen.append(cache.length)
        truncate(length)

    cache.truncate = watched          # on this instance only, for the duration of one step
    try:
        yield
    finally:
        del cache.truncate


def take_step(dec: SpeculativeDecoder) -> StepView:
    """`dec.step()`, watching the lengths of the target's and the drafter's caches around its rollback."""
    if dec.done:
        raise ValueError(f"the decode has finished ({dec.trace.stop_reason}): make a new SpeculativeDecoder")
    draft_cache = getattr(dec.drafter, "cache", None)   # a drafter with a KV cache (the draft model) has one
    context, t_before = list(dec.tokens), dec.cache.length
    d_before = draft_cache.length if draft_cache is not None else 0
    t_seen, d_seen = [], []
    with _peak_at_rollback(dec.cache, t_seen):
        if draft_cache is not None:
            with _peak_at_rollback(draft_cache, d_seen):
                step = dec.step()
        else:
            step = dec.step()
    target = CacheLengths(t_before, t_seen[0] if t_seen else dec.cache.length, dec.cache.length)
    draft = None if draft_cache is None else \
        CacheLengths(d_before, d_seen[0] if d_seen else draft_cache.length, draft_cache.length)
    return StepView(len(dec.trace.steps) - 1, context, step, target, draft)


def token_text(tokenizer, token: int) -> str:
    """A token's text with its whitespace made visible (␣ space, ↵ newline, → tab)."""
    return tokenizer.decode([token]).replace(" ", "␣").replace("\n", "↵").replace("\t", "→")


def _chip(text: str, kind: str, note: str = "") -> str:
    style = CSS.get(kind, "") or "background:#eee"
    sub = f'<br><span style="font-size:x-small;color:#555">{_html.escape(note)}</span>' if note else ""
    return (f'<span class="lk-{kind}" style="{style};display:inline-block;padding:1px 5px;margin:1px;'
            f'border-radius:3px;text-align:center">{_html.escape(text)}{sub}</span>')


def _cache_bar(name: str, c: CacheLengths, scale: float) -> str:
    """Kept slots grey, slots written this step and kept green, slots rolled back red."""
    kept_before = min(c.before, c.after)
    seg = [(kept_before, "#bbb"), (c.after - kept_before, "#6cc36a"), (c.dropped, "#e57373")]
    bar = "".join(f'<span style="display:inline-block;height:10px;width:{n * scale:.1f}px;background:{col}"></span>'
                  for n, col in seg if n > 0)
    return (f'<div class="lk-cache" style="margin:2px 0"><span style="display:inline-block;width:9em">{name} cache</span>'
            f'{bar}<span style="margin-left:6px">{c.before} → {c.peak} (written) → <b>{c.after}</b> '
            f'(rolled back {c.dropped})</span></div>')


def step_html(view: StepView, tokenizer, context_tokens: int = 12) -> str:
    """One step as HTML: proposal, verdicts, what was committed, and both caches' rollback."""
    s = view.step
    tail = tokenizer.decode(view.context[-context_tokens:])
    proposed = "".join(_chip(token_text(tokenizer, t), "draft", f"q={q:.2f}") for t, q in zip(s.proposed, s.q_draft))
    verdicts = []
    for i, (t, p) in enumerate(zip(s.proposed, s.p_target)):
        if i < s.n_accepted:
            verdicts.append(_chip("✓ " + token_text(tokenizer, t), "accepted", f"p={p:.2f}"))
        elif i == s.n_accepted:
            verdicts.append(_chip("✗ " + token_text(tokenizer, t), "rejected", f"p={p:.2f}"))
        else:
            verdicts.append(_chip(token_text(tokenizer, t), "rejected", "after a rejection"))
    own = "bonus" if s.bonus else ("correction" if s.proposed else "target")
    verdicts.append(_chip("+ " + token_text(tokenizer, s.next_token), own, f"target's {own}"))
    kept = s.accepted_tokens
    committed = "".join(_chip(token_text(tokenizer, t), "accepted") for t in kept) + \
        _chip(token_text(tokenizer, s.next_token), own)
    longest = max(view.target_cache.peak, view.draft_cache.peak if view.draft_cache else 0, 1)
    caches = _cache_bar("target", view.target_cache, 360 / longest)
    if view.draft_cache is not None:
        caches += _cache_bar("draft", view.draft_cache, 360 / longest)
    head = (f"step {view.index + 1}: γ = {s.gamma}, accepted {s.n_accepted} of {s.gamma}, "
            f"committed {s.n_committed} token{'s' if s.n_committed > 1 else ''}")
    if s.plain_by_choice:
        head = f"step {view.index + 1}: γ = 0, a plain step (drafting would not pay here), committed 1 token"
        if s.shadow:
            head += (f"; the drafter guessed {s.shadow} token{'s' if s.shadow > 1 else ''} unverified, which the "
                     "next tokens judge, to learn when drafting pays again")
    nothing = "<i>nothing: γ = 0 was cheaper in expectation</i>" if s.plain_by_choice else "<i>nothing (no match)</i>"
    rows = [("context", f'<span style="color:#777;white-space:pre-wrap">…{_html.escape(tail)}</span>'),
            ("1. draft proposes", proposed or nothing),
            ("2. target verifies", "".join(verdicts)),
            ("3. committed", committed),
            ("4. rollback", caches)]
    table = "".join(f'<tr><td style="text-align:left;vertical-align:top;padding-right:8px;white-space:nowrap">'
                    f"<b>{k}</b></td><td style=\"text-align:left\">{v}</td></tr>" for k, v in rows)
    return (f'<div class="lk-step" style="font-family:monospace"><div class="lk-step-head" style="font-weight:bold">'
            f"{_html.escape(head)}</div><table>{table}</table></div>")


def step_frame(view: StepView, dec: SpeculativeDecoder, tokenizer, when_done: str = "") -> str:
    """What the stepper shows after a step: `step_html`, "done" once the decode has ended (then `when_done`), and
    the answer so far in coloured tokens. The recorded runs (replay.record_steps) store the same frames."""
    done = f"<p><b>done</b> ({dec.trace.stop_reason}){when_done}</p>" if dec.done else ""
    answer = to_html(pieces(dec.trace, dec.prompt.tolist(), tokenizer))
    return step_html(view, tokenizer) + done + "<p><b>the answer so far</b></p>" + answer


class Stepper:
    """A "next step" button and a γ slider over a speculative decode; moving γ restarts the decode.

    make_decoder(gamma) returns a fresh SpeculativeDecoder; each step shows `step_html`, the
    answer so far with coloured tokens, and a plot of every step's commits and cache rollbacks.
    """

    def __init__(self, make_decoder: Callable[[int], SpeculativeDecoder], tokenizer, gamma: int = 4,
                 max_gamma: int = 10):
        import ipywidgets as w
        if not 1 <= gamma <= max_gamma:
            raise ValueError(f"gamma must lie in [1, max_gamma={max_gamma}], got {gamma}")
        self.make_decoder, self.tokenizer = make_decoder, tokenizer
        self.button = w.Button(description="next step", icon="step-forward", button_style="primary")
        self.slider = w.IntSlider(value=gamma, min=1, max=max_gamma, description="γ", continuous_update=False)
        self.out = w.Output()
        self.widget = w.VBox([w.HBox([self.button, self.slider]), self.out])
        self.button.on_click(lambda _: self.next_step())
        self.slider.observe(lambda change: self.restart(change["new"]), names="value")
        self.restart(gamma)

    def restart(self, gamma: int) -> None:
        """A fresh decode with this γ, and its first step."""
        self.decoder, self.views = self.make_decoder(gamma), []
        self.next_step()

    def next_step(self) -> StepView | None:
        view = None
        if not self.decoder.done:
            view = take_step(self.decoder)
            self.views.append(view)
        self.show()
        return view

    def show(self) -> None:
        import matplotlib.pyplot as plt
        from IPython.display import HTML, clear_output, display

        from .plots import plot_cache_rollback, plot_steps
        dec = self.decoder
        fig, (ax_steps, ax_cache) = plt.subplots(1, 2, figsize=(10, 2.8))
        plot_steps(dec.trace, ax_steps)
        plot_cache_rollback([v.target_cache for v in self.views], ax_cache)
        fig.tight_layout()
        with self.out:
            clear_output(wait=True)
            display(HTML(step_frame(self.views[-1], dec, self.tokenizer, ": move γ to start again")))
            display(fig)
        plt.close(fig)

    def _ipython_display_(self) -> None:
        from IPython.display import display
        display(self.widget)
