"""A vLLM server's speculative-decoding counters, read from its `/metrics` page into labkit's acceptance views.

`curl http://HOST:8000/metrics > metrics.txt` while (or after) a `vllm serve ... --speculative-config ...` runs
saves Prometheus' text format; vLLM's four counters there (labelled by model_name and engine; the last one also
by position) become one DraftCounts, summed over the engines:

    vllm:spec_decode_num_drafts_total                       drafts verified
    vllm:spec_decode_num_draft_tokens_total                 draft tokens proposed
    vllm:spec_decode_num_accepted_tokens_total              draft tokens accepted
    vllm:spec_decode_num_accepted_tokens_per_pos_total      ... at draft position i (label position="i")

The counters count from the server's start: two dumps subtracted (`later - earlier`) give one interval's.
"""
from __future__ import annotations

import math
from pathlib import Path

from ..core.engine_counts import DraftCounts
from ..files.textfile import read_text

PREFIX = "vllm:spec_decode_num_"
COUNTERS = ("drafts", "draft_tokens", "accepted_tokens", "accepted_tokens_per_pos")
MAX_BYTES = 64 * 2**20


def parse_vllm_metrics(text: str, model_name: str | None = None, source: str = "the metrics") -> DraftCounts:
    """The spec-decode counters in a Prometheus text dump, summed over engines (of `model_name` where given)."""
    from prometheus_client.parser import text_string_to_metric_families
    values: dict[str, dict[tuple, float]] = {c: {} for c in COUNTERS}
    try:
        for family in text_string_to_metric_families(text):
            counter = family.name.removeprefix(PREFIX).removesuffix("_total")
            if not family.name.startswith(PREFIX) or counter not in values:
                continue
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                values[counter][tuple(sorted(sample.labels.items()))] = sample.value
    except ValueError as e:
        raise ValueError(f"{source} is not Prometheus' text format ({e}): save a vLLM server's /metrics page") from e
    if not any(values.values()):
        raise ValueError(f"{source} holds no {PREFIX}* counters: it is not a vLLM server's /metrics page, or the "
                         "server ran without --speculative-config")
    models = sorted({dict(k).get("model_name", "") for v in values.values() for k in v})
    if model_name is None and len(models) > 1:
        raise ValueError(f"{source} counts {len(models)} models ({', '.join(models)}): name one with model_name")
    if model_name is not None and model_name not in models:
        raise ValueError(f"{source} counts no model {model_name!r}; it counts {', '.join(models)}")
    mine = {c: {k: x for k, x in v.items() if model_name is None or dict(k).get("model_name") == model_name}
            for c, v in values.items()}
    for c, v in mine.items():
        for labels, x in v.items():
            if not math.isfinite(x) or x < 0 or x != int(x):
                raise ValueError(f"{source}: {PREFIX}{c}{dict(labels)} = {x} is not a count")
    total = {c: int(sum(mine[c].values())) for c in COUNTERS[:3]}
    per_pos: dict[int, int] = {}
    for labels, x in mine["accepted_tokens_per_pos"].items():
        position = dict(labels).get("position", "")
        if not position.isdigit():
            raise ValueError(f"{source}: {PREFIX}accepted_tokens_per_pos has position {position!r}, not 0, 1, ...")
        per_pos[int(position)] = per_pos.get(int(position), 0) + int(x)
    if sorted(per_pos) != list(range(len(per_pos))):
        raise ValueError(f"{source}: the per-position counters skip a position ({sorted(per_pos)})")
    return DraftCounts(total["drafts"], total["draft_tokens"], total["accepted_tokens"],
                       tuple(per_pos[i] for i in range(len(per_pos))))


def read_vllm_metrics(path: str | Path, model_name: str | None = None, what: str = "the metrics file") -> DraftCounts:
    """parse_vllm_metrics of a saved /metrics page; `what` names the argument the path came from."""
    return parse_vllm_metrics(read_text(path, what, max_bytes=MAX_BYTES), model_name, source=f"{what} {path}")
