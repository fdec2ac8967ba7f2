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
    axes = {"temperature": (0.5, 1.0), "top-k": (5, 50)}
    Replay(figure_grid(draw, axes), name=tuple(axes))                       # a slider per parameter, every pair drawn

Why not a widget library: ipywidgets' views need a kernel, or its HTML manager fetched from a
CDN to draw saved state, and a custom widget (anywidget) needs the same manager in a static
page. The frames are HTML the library already draws and tests; switching between them is all
the front end has to do.
"""
from __future__ import annotations

import html as _html
import itertools
import json
import re
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


def figure_frame(fig, caption: str = "") -> str:
    """A matplotlib figure as one frame (an embedded PNG), with a caption below it (plain text, **bold** kept);
    the figure is closed, so the notebook does not also show it. The PNG keeps 256 colours, plenty for a plot
    and about a third of the bytes: a grid of frames is stored in the notebook."""
    import base64
    import io

    import matplotlib.pyplot as plt
    from PIL import Image
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    plt.close(fig)
    small = io.BytesIO()
    Image.open(buf).convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT).save(small, format="PNG", optimize=True)
    img = f'<img alt="recorded figure" src="data:image/png;base64,{base64.b64encode(small.getvalue()).decode()}">'
    if not caption:
        return img
    text = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", _html.escape(caption))
    return f'{img}<div style="font-family:sans-serif;font-size:14px;max-width:60em">{text}</div>'


def figure_grid(draw: Callable[..., object], axes: dict[str, list], progress: bool = True) -> dict:
    """{setting: [frame]} for every combination of the values in `axes` ({name: values}): `draw(*setting)` returns a
    matplotlib figure, or (figure, caption), drawn once here. Keys are tuples in `axes`' order (plain values when
    there is one axis), as `replay_html` takes them with name=tuple(axes)."""
    if not axes or any(len(v) == 0 for v in axes.values()):
        raise ValueError(f"axes must give each parameter one or more values, got {axes!r}")
    combos = list(itertools.product(*axes.values()))
    frames = {}
    for c in tqdm(combos, desc="drawing", disable=not progress):
        drawn = draw(*c)
        frames[c if len(axes) > 1 else c[0]] = [figure_frame(*drawn) if isinstance(drawn, tuple) else figure_frame(drawn)]
    return frames


def replay_html(frames: dict, name="γ", start=None, element_id: str | None = None) -> str:
    """The replay as one self-contained HTML fragment: a slider for each parameter, step buttons and a step slider
    when the runs have steps, and the start's first frame already drawn (so a page that runs no script still shows
    one). `name` is one parameter's name, with `frames` keyed by its values; or a tuple of names, with `frames` keyed
    by tuples of values, one for every combination (a grid: temperature × top-k)."""
    names = (name,) if isinstance(name, str) else tuple(name)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"name must be a parameter's name or a tuple of names, got {name!r}")
    if not frames or any(not f for f in frames.values()):
        raise ValueError("frames must map each value of the parameter to one or more recorded steps")
    keys = list(frames)
    tuples = [k if isinstance(k, tuple) else (k,) for k in keys] if len(names) > 1 else [(k,) for k in keys]
    if any(len(t) != len(names) for t in tuples):
        raise ValueError(f"frames must be keyed by tuples of {len(names)} values ({', '.join(names)}), got {keys[0]!r}")
    axes = [list(dict.fromkeys(t[d] for t in tuples)) for d in range(len(names))]      # each parameter's values
    recorded = set(tuples)
    missing = [c for c in itertools.product(*axes) if c not in recorded]
    if missing:
        raise ValueError(f"frames must hold every combination of {', '.join(names)}: missing {missing[:3]}")
    start = keys[len(keys) // 2] if start is None else start
    if start not in frames:
        raise ValueError(f"start must be one of the recorded values {keys}, got {start!r}")
    at = tuples[keys.index(start)]
    rid = element_id or f"lk-replay-{uuid.uuid4().hex[:10]}"
    stepped = any(len(f) > 1 for f in frames.values())
    data = json.dumps({"names": names, "axes": [[str(v) for v in a] for a in axes],
                       "index": {",".join(str(a.index(v)) for a, v in zip(axes, t)): i for i, t in enumerate(tuples)},
                       "frames": [frames[k] for k in keys], "start": [a.index(v) for a, v in zip(axes, at)]}
                      ).replace("</", "<\\/")                                     # no "</script>" inside the data
    label = ", ".join(f"{n} = {v}" for n, v in zip(names, at)) + (f", step 1 of {len(frames[start])}" if stepped else "")
    sliders = "".join(
        f'<label>{_html.escape(n)} <input class="lk-replay-key" data-axis="{d}" type="range" min="0" '
        f'max="{len(axes[d]) - 1}" step="1" value="{axes[d].index(at[d])}" style="vertical-align:middle"></label>\n'
        for d, n in enumerate(names))
    button = ('<button class="lk-replay-{0}" style="margin-right:4px;padding:2px 10px;font-size:14px;'
              'cursor:pointer">{1}</button>')
    steps = (f'{button.format("prev", "◀ step")}{button.format("next", "step ▶")}\n<input class="lk-replay-step" '
             f'type="range" min="1" max="{len(frames[start])}" step="1" value="1" style="vertical-align:middle" '
             'aria-label="step">\n') if stepped else ""
    what = "a recorded run: plays without a kernel" if stepped else "precomputed: changes without a kernel"
    return f"""<div id="{rid}" class="lk-replay" style="border:1px solid #ddd;border-radius:4px;padding:6px">
<div style="display:flex;align-items:center;gap:10px;flex-wrap:wrap;font-family:sans-serif;font-size:14px">
{sliders}{steps}<span class="lk-replay-label">{_html.escape(label)}</span>
<span style="color:#777">({what})</span></div>
<div class="lk-replay-view" style="margin-top:6px">{frames[start][0]}</div></div>
<script type="application/json" id="{rid}-data">{data}</script>
<script>
(function () {{
  const root = document.getElementById("{rid}");
  const data = JSON.parse(document.getElementById("{rid}-data").textContent);
  const view = root.querySelector(".lk-replay-view"), label = root.querySelector(".lk-replay-label");
  const stepRange = root.querySelector(".lk-replay-step");
  let at = data.start.slice(), i = 0;
  function show() {{
    const frames = data.frames[data.index[at.join(",")]];
    i = Math.max(0, Math.min(i, frames.length - 1));
    view.innerHTML = frames[i];
    let text = data.names.map(function (n, d) {{ return n + " = " + data.axes[d][at[d]]; }}).join(", ");
    if (stepRange) {{
      stepRange.max = frames.length;
      stepRange.value = i + 1;
      text += ", step " + (i + 1) + " of " + frames.length;
    }}
    label.textContent = text;
  }}
  if (stepRange) {{
    root.querySelector(".lk-replay-prev").onclick = function () {{ i -= 1; show(); }};
    root.querySelector(".lk-replay-next").onclick = function () {{ i += 1; show(); }};
    stepRange.oninput = function () {{ i = Number(stepRange.value) - 1; show(); }};
  }}
  root.querySelectorAll(".lk-replay-key").forEach(function (range) {{
    range.oninput = function () {{ at[Number(range.dataset.axis)] = Number(range.value); i = 0; show(); }};
  }});
  show();
}})();
</script>"""


class Replay:
    """A recorded run or a grid of figures in a notebook: displays as `replay_html` (frames from `record_stepper`
    or `figure_grid`)."""

    def __init__(self, frames: dict, name: str | tuple[str, ...] = "γ", start=None):
        replay_html(frames, name, start, element_id="lk-replay-check")          # bad input fails here, not on display
        self.frames, self.name, self.start = frames, name, start

    def _repr_html_(self) -> str:
        return replay_html(self.frames, self.name, self.start)
