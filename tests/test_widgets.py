"""The stepper: one step's view (both caches' rollback measured, not assumed), its HTML, and the widget."""
import pytest
import torch
from conftest import tiny_tokenizer

from labkit import (
    DraftModelDrafter,
    PromptLookupDrafter,
    SpeculativeDecoder,
    speculative_generate,
)
from labkit.viz.widgets import Stepper, step_html, take_step, token_text

PROMPT = torch.tensor([5, 17, 33, 2, 9])


def test_take_step_measures_both_rollbacks(tiny_target, tiny_draft):
    dec = SpeculativeDecoder(tiny_target, DraftModelDrafter(tiny_draft), PROMPT, max_new_tokens=40, gamma=4)
    views = [take_step(dec) for _ in range(8)]
    assert any(v.step.n_accepted < v.step.gamma for v in views), "the test needs a rejection"
    for i, v in enumerate(views):
        n, s = len(v.context), v.step
        t, d = v.target_cache, v.draft_cache
        assert v.index == i
        assert t.before == n - (i > 0)                 # every committed token but the last (first: all of them)
        assert t.peak == n + s.gamma                   # verify fed the last token (first: the prefill had it) + γ
        assert t.after == n + s.n_accepted             # kept: up to the accepted prefix
        assert t.dropped == s.gamma - s.n_accepted
        assert d.peak == n + s.gamma - 1               # the draft saw all committed and γ-1 of its own
        assert d.after == min(d.peak, n + s.n_accepted)
    assert views[-1].target_cache.after == dec.cache.length == len(dec.tokens) - 1


def test_stepping_equals_one_shot_generation(tiny_target, tiny_draft):
    dec = SpeculativeDecoder(tiny_target, DraftModelDrafter(tiny_draft), PROMPT, max_new_tokens=30, gamma=3)
    while not dec.done:
        take_step(dec)
    ref = speculative_generate(tiny_target, DraftModelDrafter(tiny_draft), PROMPT, max_new_tokens=30, gamma=3)
    assert dec.tokens[len(PROMPT):] == ref.tokens
    assert "truncate" not in vars(dec.cache), "the rollback watch must be removed after the step"
    with pytest.raises(ValueError, match="finished"):
        take_step(dec)


def test_drafter_without_cache_has_no_draft_bar(tiny_target):
    prompt = torch.tensor([7, 8, 9, 7, 8, 9, 7, 8])
    dec = SpeculativeDecoder(tiny_target, PromptLookupDrafter(), prompt, max_new_tokens=10, gamma=3)
    v = take_step(dec)
    assert v.draft_cache is None
    assert v.step.proposed == [9, 7, 8]
    html = step_html(v, tiny_tokenizer())
    assert "draft cache" not in html and "target cache" in html


def test_step_html_labels_every_token(tiny_target, tiny_draft):
    tok = tiny_tokenizer()
    dec = SpeculativeDecoder(tiny_target, DraftModelDrafter(tiny_draft), PROMPT, max_new_tokens=40, gamma=4)
    views = [take_step(dec) for _ in range(8)]
    rejected = next(v for v in views if v.step.n_accepted < v.step.gamma)
    html = step_html(rejected, tok)
    s = rejected.step
    assert f"accepted {s.n_accepted} of {s.gamma}" in html
    assert html.count('class="lk-draft"') == s.gamma
    assert html.count('class="lk-accepted"') == 2 * s.n_accepted      # in the verdict row and the committed row
    assert html.count('class="lk-rejected"') == s.gamma - s.n_accepted
    assert html.count('class="lk-correction"') == 2 and "lk-bonus" not in html
    c = rejected.target_cache
    assert f"{c.before} → {c.peak} (written) → <b>{c.after}</b>" in html


def test_a_plain_step_by_choice_is_shown_as_one(tiny_target):
    """A cost-aware policy that chose γ = 0 (a draft that never agrees, at no cost): the stepper says so."""
    from test_tree_budget import Oracle

    from labkit.tuning import CostAwareGamma, Shadowed
    tok = tiny_tokenizer()
    wrong = Oracle([1] * 200, 10**6, tiny_target.vocab_size)
    dec = SpeculativeDecoder(tiny_target, wrong, PROMPT, 40,
                             Shadowed(CostAwareGamma(start=3, warmup=2, probe_every=8), wrong))
    views = [take_step(dec) for _ in range(6)]
    plain = next(v for v in views if v.step.plain_by_choice)
    assert plain.step.asked == 0 and not plain.step.proposed and dec.trace.summary()["plain_steps"] >= 1
    html = step_html(plain, tok)
    assert "γ = 0, a plain step (drafting would not pay here)" in html and "γ = 0 was cheaper" in html
    drafted = next(v for v in views if v.step.asked)
    assert "a plain step" not in step_html(drafted, tok)


def test_token_text_shows_whitespace():
    tok = tiny_tokenizer()
    assert token_text(tok, tok.convert_tokens_to_ids("Ġ")) == "␣"
    assert token_text(tok, tok.convert_tokens_to_ids("Ċ")) == "↵"


def test_stepper_buttons_and_gamma_slider(tiny_target, tiny_draft):
    made = []

    def make(gamma):
        made.append(gamma)
        return SpeculativeDecoder(tiny_target, DraftModelDrafter(tiny_draft), PROMPT, max_new_tokens=12, gamma=gamma)

    stepper = Stepper(make, tiny_tokenizer(), gamma=3)
    assert made == [3] and len(stepper.views) == 1
    stepper.button.click()
    stepper.button.click()
    assert len(stepper.views) == 3 and all(v.step.gamma <= 3 for v in stepper.views)
    stepper.slider.value = 5                                # a new γ restarts the decode and takes its first step
    assert made == [3, 5] and len(stepper.views) == 1 and stepper.views[0].step.gamma == 5
    while not stepper.decoder.done:
        stepper.button.click()
    n = len(stepper.views)
    assert stepper.next_step() is None and len(stepper.views) == n   # a finished decode stays put
    with pytest.raises(ValueError, match="gamma"):
        Stepper(make, tiny_tokenizer(), gamma=0)


def test_a_replay_holds_every_recorded_step_and_plays_without_a_kernel(tiny_target, tiny_draft):
    import json
    import re

    from labkit.viz.replay import Replay, record_stepper, record_steps, replay_html
    tok = tiny_tokenizer()

    def make(gamma):
        return SpeculativeDecoder(tiny_target, DraftModelDrafter(tiny_draft), PROMPT, max_new_tokens=20, gamma=gamma)
    frames = record_stepper(make, tok, gammas=(1, 4), progress=False)
    for g, fs in frames.items():                                     # one frame per step of a full decode
        dec = make(g)
        while not dec.done:
            take_step(dec)
        assert len(fs) == len(dec.trace.steps)
        assert f"step {len(fs)}:" in fs[-1] and "done" in fs[-1] and "the answer so far" in fs[0]
    html = replay_html(frames, start=4, element_id="lk-replay-test")
    data = json.loads(re.search(r'<script type="application/json" id="lk-replay-test-data">(.*?)</script>',
                                html, re.S).group(1))
    assert data["axes"] == [["1", "4"]] and data["start"] == [1] and data["frames"] == [frames[1], frames[4]]
    assert data["index"] == {"0": 0, "1": 1} and "γ = 4, step 1 of" in html
    view = re.search(r'<div class="lk-replay-view"[^>]*>(.*?)</div></div>\n<script', html, re.S).group(1)
    assert view == frames[4][0]                                      # drawn before any script runs
    assert "http" not in html.split('<script type="application/json"')[0].split("lk-replay-view")[0]
    with pytest.raises(ValueError, match="start must be one of"):
        Replay(frames, start=3)
    with pytest.raises(ValueError, match="gammas"):
        record_stepper(make, tok, gammas=(0,))
    with pytest.raises(ValueError, match="max_steps"):
        record_steps(make(2), tok, max_steps=0)


def test_a_figure_is_a_frame_and_is_not_shown_twice():
    import base64
    import re

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from labkit.viz.replay import Replay, figure_frame
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    frame = figure_frame(fig)
    assert not plt.fignum_exists(fig.number), "the figure must be closed once it is a frame"
    png = base64.b64decode(re.search(r'base64,([^"]+)"', frame).group(1))
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    html = Replay({4: [frame], 8: [frame]}, name="budget", start=8)._repr_html_()
    assert "budget = 8</span>" in html and 'class="lk-replay-step"' not in html   # one frame each: no step controls


def test_a_grid_has_a_slider_per_parameter_and_every_combination():
    import json
    import re

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from labkit.viz.replay import Replay, figure_grid, replay_html
    drawn = []

    def draw(t, k):
        drawn.append((t, k))
        fig, ax = plt.subplots()
        ax.set_title(f"{t} {k}")
        return fig
    axes = {"temperature": (0.5, 1.0, 1.5), "top-k": (5, 50)}
    frames = figure_grid(draw, axes, progress=False)
    assert drawn == [(t, k) for t in axes["temperature"] for k in axes["top-k"]] and list(frames) == drawn
    html = replay_html(frames, name=tuple(axes), start=(1.5, 5), element_id="lk-replay-grid")
    data = json.loads(re.search(r'id="lk-replay-grid-data">(.*?)</script>', html, re.S).group(1))
    assert data["names"] == ["temperature", "top-k"] and data["axes"] == [["0.5", "1.0", "1.5"], ["5", "50"]]
    assert data["start"] == [2, 0] and data["frames"][data["index"]["2,0"]] == frames[(1.5, 5)]
    assert data["frames"][data["index"]["0,1"]] == frames[(0.5, 50)]
    assert html.count('class="lk-replay-key"') == 2 and "temperature = 1.5, top-k = 5</span>" in html
    with pytest.raises(ValueError, match="every combination"):
        Replay({k: v for k, v in frames.items() if k != (1.0, 50)}, name=tuple(axes))
    with pytest.raises(ValueError, match="tuples of 2 values"):
        Replay({0.5: frames[(0.5, 5)]}, name=tuple(axes))
    with pytest.raises(ValueError, match="one or more values"):
        figure_grid(draw, {"temperature": ()})
