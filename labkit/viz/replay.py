"""A recorded run that plays without a kernel: the stepper's own views, scrubbed by the page's JavaScript.

The stepper (widgets.Stepper) takes each step live, so it does nothing until the models are
loaded. A replay is that run recorded: every step of a real decode at each setting of a
parameter (γ), drawn by the stepper's own `step_html`, stored in the notebook's output with a
few lines of plain JavaScript that switch between them. It needs no kernel, no widget manager
and no network: JupyterLab plays it in a trusted notebook (`make lab` trusts them), and so does
the static book (`make book`) in any browser, opened as a file.

    frames = record_stepper(make_decoder, tokenizer, gammas=(1, 2, 4, 8))   # runs the models once
    Replay(frames, name="γ")                                                # displays; plays anywhere
    Replay({b: [figure_frame(draw(b))] for b in (4, 8, 16)}, name="budget")  # any HTML frames: figures too

Why not a widget library: ipywidgets' views need a kernel, or its HTML manager fetched from a
CDN to draw saved state, and a custom widget (anywidget) needs the same manager in a static
page. The frames are HTML the library already draws and tests; switching between them is all
the front end has to do.
"""
from __future__ import annotations

import html as _html
import json
import uuid
from typing import Callable

from tqdm.auto import tqdm

from ..decoding.speculative import SpeculativeDecoder
from .widgets import step_frame, take_step


def record_steps(dec: SpeculativeDecoder, tokenizer, max_steps: int = 200) -> list[str]:
    """Every step of `dec` to its end (EOS or max_new_tokens), each as the stepper draws it: the step, then the
    answer so far. One HTML frame a step."""
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    frames = []
    while not dec.done and len(frames) < max_steps:
        frames.append(step_frame(take_step(dec), dec, tokenizer))
    return frames


def record_stepper(make_decoder: Callable[[int], SpeculativeDecoder], tokenizer, gammas=(1, 2, 4, 8),
                   progress: bool = True) -> dict[int, list[str]]:
    """{γ: frames}: a full decode at each γ, recorded step by step (make_decoder(γ) as for the Stepper)."""
    gammas = list(gammas)
    if not gammas or any(g < 1 for g in gammas):
        raise ValueError(f"gammas must be one or more draft lengths >= 1, got {gammas}")
    return {g: record_steps(make_decoder(g), tokenizer) for g in tqdm(gammas, desc="recording", disable=not progress)}


def figure_frame(fig) -> str:
    """A matplotlib figure as one frame (an embedded PNG); the figure is closed, so the notebook does not also
    show it."""
    import base64
    import io

    import matplotlib.pyplot as plt
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    plt.close(fig)
    return f'<img alt="recorded figure" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def replay_html(frames: dict, name: str = "γ", start=None, element_id: str | None = None) -> str:
    """The replay as one self-contained HTML fragment: a slider over `name`'s values, step buttons and a step
    slider, and the first frame already drawn (so a page that runs no script still shows one step)."""
    if not frames or any(not f for f in frames.values()):
        raise ValueError("frames must map each value of the parameter to one or more recorded steps")
    keys = list(frames)
    start = keys[len(keys) // 2] if start is None else start
    if start not in frames:
        raise ValueError(f"start must be one of the recorded values {keys}, got {start!r}")
    rid = element_id or f"lk-replay-{uuid.uuid4().hex[:10]}"
    data = json.dumps({"name": name, "keys": [str(k) for k in keys], "frames": [frames[k] for k in keys],
                       "start": keys.index(start)}).replace("</", "<\\/")       # no "</script>" inside the data
    first = frames[start][0]
    label = f"{name} = {start}, step 1 of {len(frames[start])}"
    button = ('<button class="lk-replay-{0}" style="margin-right:4px;padding:2px 10px;font-size:14px;'
              'cursor:pointer">{1}</button>')
    return f"""<div id="{rid}" class="lk-replay" style="border:1px solid #ddd;border-radius:4px;padding:6px">
<div style="display:flex;align-items:center;gap:10px;flex-wrap:wrap;font-family:sans-serif;font-size:14px">
<label>{_html.escape(name)} <input class="lk-replay-key" type="range" min="0" max="{len(keys) - 1}" step="1"
 value="{keys.index(start)}" style="vertical-align:middle"></label>
{button.format("prev", "◀ step")}{button.format("next", "step ▶")}
<input class="lk-replay-step" type="range" min="1" max="{len(frames[start])}" step="1" value="1"
 style="vertical-align:middle" aria-label="step">
<span class="lk-replay-label">{_html.escape(label)}</span>
<span style="color:#777">(a recorded run: plays without a kernel)</span></div>
<div class="lk-replay-view" style="margin-top:6px">{first}</div></div>
<script type="application/json" id="{rid}-data">{data}</script>
<script>
(function () {{
  const root = document.getElementById("{rid}");
  const data = JSON.parse(document.getElementById("{rid}-data").textContent);
  const view = root.querySelector(".lk-replay-view"), label = root.querySelector(".lk-replay-label");
  const keyRange = root.querySelector(".lk-replay-key"), stepRange = root.querySelector(".lk-replay-step");
  let k = data.start, i = 0;
  function show() {{
    const frames = data.frames[k];
    i = Math.max(0, Math.min(i, frames.length - 1));
    stepRange.max = frames.length;
    stepRange.value = i + 1;
    view.innerHTML = frames[i];
    label.textContent = data.name + " = " + data.keys[k] + ", step " + (i + 1) + " of " + frames.length;
  }}
  root.querySelector(".lk-replay-prev").onclick = function () {{ i -= 1; show(); }};
  root.querySelector(".lk-replay-next").onclick = function () {{ i += 1; show(); }};
  stepRange.oninput = function () {{ i = Number(stepRange.value) - 1; show(); }};
  keyRange.oninput = function () {{ k = Number(keyRange.value); i = 0; show(); }};
  show();
}})();
</script>"""


class Replay:
    """A recorded run in a notebook: displays as `replay_html` (frames from `record_stepper`)."""

    def __init__(self, frames: dict, name: str = "γ", start=None):
        replay_html(frames, name, start, element_id="lk-replay-check")          # bad input fails here, not on display
        self.frames, self.name, self.start = frames, name, start

    def _repr_html_(self) -> str:
        return replay_html(self.frames, self.name, self.start)
