"""How long `load_model` takes for a preset in each precision on this machine: each load in a fresh process.

    python scripts/load_time.py --precisions bf16,fp32,int4 --repeats 2 --out data/bench/load_time_CPU.json

The forward path is the one `load_model` chooses (backend auto: calibrated, or read from the cache of an
earlier calibration). Prints one line per load and writes the JSON: CPU, ISA, load average, seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ONE_LOAD = """
import json, sys, time, torch
torch.set_num_threads(2)
from labkit.models.loading import load_model
t0 = time.perf_counter()
m = load_model(sys.argv[1], dtype=sys.argv[2], progress=False)
print(json.dumps({"seconds": time.perf_counter() - t0, "path": str(m.path)}))
"""


def main() -> None:
    from labkit.models.calibrate import isa_label, machine
    from labkit.models.hub import DEFAULT_TARGET
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_TARGET)
    p.add_argument("--precisions", default="bf16,fp32,int4")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    if a.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {a.repeats}")
    m = machine()
    rows = []
    for precision in a.precisions.split(","):
        for _ in range(a.repeats):
            res = subprocess.run([sys.executable, "-c", ONE_LOAD, a.model, precision], capture_output=True, text=True)
            if res.returncode:
                raise SystemExit(f"loading {a.model} in {precision} failed:\n{res.stderr[-2000:]}")
            row = {"precision": precision, **json.loads(res.stdout.strip().splitlines()[-1])}
            print(f"{precision}: {row['seconds']:.1f} s ({row['path']})", flush=True)
            rows.append(row)
    out = {"model": a.model, "cpu": m["cpu"], "isa": isa_label(m), "threads": 2, "torch": m["torch"],
           "load_average_at_end": [round(x, 2) for x in os.getloadavg()], "loads": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
