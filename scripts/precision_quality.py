"""What a lower precision costs in quality: each precision of the target against its bf16 self.

    python scripts/precision_quality.py          # -> data/bench/precision_quality.{json,md}

A quantized target is a model of its own: speculative decoding reproduces its plain decoding token
for token, not the bf16 model's. This measures how far it is from bf16 on held-out text the lab
never trains or calibrates on: Python's `difflib.py` (code) and the language reference's prose in
`pydoc_data/topics.py` (English), 1024 tokens each, read teacher-forced in 256-token forwards.
Per precision and text: perplexity, top-1 agreement with the bf16 model's next token, and the mean
KL divergence KL(bf16 || precision) of the next-token distributions.
"""
from __future__ import annotations

import argparse
import inspect
import math
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm.auto import tqdm

from labkit.bench.writer import markdown_table, write_outputs
from labkit.models.calibrate import isa_label, load_average, machine
from labkit.models.hub import DEFAULT_TARGET
from labkit.models.loading import load_model

ROOT = Path(__file__).resolve().parents[1]
# (precision, forward path): bf16 first, the reference the others are compared with
SETTINGS = (("bf16", "auto"), ("int8", "reference"), ("int4", "packed"), ("int4", "reference"))
WHAT = {("bf16", "auto"): "bf16 weights", ("int8", "reference"): "int8 weights, bf16 activations (torch)",
        ("int4", "packed"): "int4 weights, int8 activations (labkit's kernel)",
        ("int4", "reference"): "int4 weights, bf16 activations (torch)"}


def held_out_texts() -> dict[str, str]:
    import difflib
    from pydoc_data import topics
    prose = "\n\n".join(topics.topics[k] for k in ("assignment", "for", "if", "while", "try", "with", "function"))
    return {"code (difflib.py)": inspect.getsource(difflib), "English (language reference)": prose}


@torch.no_grad()
def read(model, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Log-probabilities of every next token, (T - 1, V) fp32, in `chunk`-token forwards over one cache."""
    cache = model.new_cache(max_len=ids.numel())
    out = []
    for s in range(0, ids.numel() - 1, chunk):
        piece = ids[s: min(ids.numel() - 1, s + chunk)]
        out.append(model(piece[None].to(model.device), cache)[0].float().log_softmax(-1))    # (t, V)
    return torch.cat(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_TARGET)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens of each text")
    ap.add_argument("--chunk", type=int, default=256, help="tokens per forward")
    ap.add_argument("--out", default=str(ROOT / "data/bench"))
    a = ap.parse_args()
    m = machine()
    load0 = load_average()
    texts, reference, rows = held_out_texts(), {}, []
    for precision, backend in tqdm(SETTINGS, desc="precisions"):
        t0 = time.perf_counter()
        loaded = load_model(a.model, precision, backend, progress=False)
        for name, text in texts.items():
            ids = torch.tensor(loaded.tokenizer(text, add_special_tokens=False)["input_ids"][: a.tokens])
            logp = read(loaded.model, ids, a.chunk)                                 # (T - 1, V)
            nll = -logp.gather(1, ids[1:, None]).mean().item()
            if name not in reference:
                reference[name] = logp
            ref = reference[name]
            agree = (logp.argmax(-1) == ref.argmax(-1)).float().mean().item()
            kl = (ref.exp() * (ref - logp)).sum(-1).mean().item()
            rows.append({"precision": precision, "path": str(loaded.path), "what": WHAT[precision, backend],
                         "text": name, "tokens": ids.numel(), "perplexity": math.exp(nll), "top1_agreement": agree,
                         "kl": kl})
            print(f"{WHAT[precision, backend]:52s} {name:30s} ppl {math.exp(nll):7.3f}  top-1 = bf16 {agree:.3f}  "
                  f"KL {kl:.4f}  ({time.perf_counter() - t0:.0f} s)")
        del loaded
    facts = {"cpu": m["cpu"], "isa": isa_label(m), "threads": m["threads"], "torch": m["torch"], "model": a.model,
             "tokens_per_text": a.tokens, "load_average_at_start": load0,
             "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    table = "\n".join(markdown_table(rows, {"weights": "{what}", "text": "{text}", "perplexity": "{perplexity:.3f}",
                                            "top-1 = bf16's": "{top1_agreement:.3f}", "KL(bf16 ‖ it)": "{kl:.4f}"}))
    md = (f"# The target's precisions against bf16\n\n`{a.model}` on {m['cpu']} ({isa_label(m)}), torch "
          f"{m['torch']}, {m['threads']} threads, load average {load0[0]} at the start; {a.tokens} tokens of each held-out text, teacher-forced. *top-1 = bf16's*: the share of "
          "positions where the precision's most likely next token is the bf16 model's; *KL*: the mean "
          "KL(bf16 ‖ precision) of the next-token distributions, in nats. A quantized target is a model of its "
          "own: speculative decoding on it reproduces its own plain decoding, and these numbers say how far "
          "that is from bf16's.\n\n" + table + "\n")
    write_outputs(Path(a.out) / "precision_quality", {"facts": facts, "rows": rows}, md)


if __name__ == "__main__":
    main()
