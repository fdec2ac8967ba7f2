"""Train one MTP model on the Shakespeare corpus: `python -m labkit.training.train_mtp --config data/mtp/configs/X.json`.

Deterministic (seeded windows and init, one CPU thread), bf16 autocast on CPU unless the config's
`train.precision` is "fp32" (on a CPU without native bf16, AVX2 only, autocast runs many times
slower: data/mtp/step_time.md), AdamW with warmup and cosine decay, tqdm progress. Writes
<out>/<name>.safetensors (fp16 weights) and <out>/<name>.json: the config, the corpus provenance, the training curve, the compute spent, and
the validation loss of the fp16 weights as shipped (what the tests reproduce).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..models.mtp import MTPConfig, MTPModel
from .mtp_data import fixed_windows, load_corpus, random_windows
from .mtp_loss import evaluate, headwise_backward, naive_backward

BITS_PER_NAT = 1 / math.log(2)
WINDOW_EXTRA = 8             # every model sees windows of seq_len + 8 bytes, so all train on the same bytes
N_VAL_WINDOWS = 128          # the validation set: the first 128 windows of the held-out plays
N_SLICE_WINDOWS = 8          # the small slice the tests re-evaluate
AUTOCAST = {"bf16": torch.bfloat16, "fp32": None}     # train.precision -> autocast dtype (None: plain fp32)


def train_flops_per_token(cfg: MTPConfig, seq_len: int) -> int:
    """Forward + backward matmul FLOPs per input token (6 x weights used, plus causal attention scores)."""
    d, h = cfg.dim, cfg.hidden_dim
    block = 4 * d * d + 3 * d * h
    n_blocks = cfg.n_trunk + cfg.n_head_blocks + (cfg.n_future - 1 if cfg.kind == "deepseek" else 0)
    proj = (cfg.n_future - 1) * 2 * d * d if cfg.kind == "deepseek" else 0
    unembed = cfg.n_future * d * cfg.vocab_size
    attention = n_blocks * 2 * seq_len * d            # QK^T and AV over ~T/2 keys on average, x2 FLOPs
    return 6 * (n_blocks * block + proj + unembed) + 3 * attention


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[MTPModel, dict]:
    """A shipped model (eval mode, no grads) and its provenance, from <name>.safetensors + <name>.json."""
    path = Path(path).with_suffix("")
    meta = json.loads(path.with_suffix(".json").read_text())
    model = MTPModel(MTPConfig(**meta["model"]))
    model.load_state_dict({k: v.to(dtype) for k, v in load_file(str(path.with_suffix(".safetensors"))).items()})
    return model.to(dtype).eval().requires_grad_(False), meta


def _lr(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def train(config: dict, out_dir: Path, steps: int | None = None) -> dict:
    tc, cfg = config["train"], MTPConfig(**config["model"])
    steps = steps or tc["steps"]
    precision = tc.get("precision", "bf16")
    if precision not in AUTOCAST:
        raise ValueError(f"train.precision must be one of {sorted(AUTOCAST)}, got {precision!r}: fix the config")
    autocast_dtype = AUTOCAST[precision]
    torch.manual_seed(tc["seed"])
    torch.set_num_threads(tc.get("threads", 1))
    corpus, sdist = load_corpus()
    T, B = tc["seq_len"], tc["batch_size"]
    model = MTPModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=tc["lr"], betas=(0.9, 0.95), weight_decay=tc["weight_decay"])
    backward = headwise_backward if cfg.kind == "gloeckle" else naive_backward
    gen = torch.Generator().manual_seed(tc["seed"])
    curve, t0 = [], time.perf_counter()
    bar = tqdm(range(steps), desc=config["name"], mininterval=5)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = _lr(step, steps, tc["lr"], tc["warmup"])
        window = random_windows(corpus.train, B, T + WINDOW_EXTRA, gen)                  # (B, T + 8)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            loss = backward(model, window, T)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 10 == 0 or step == steps - 1:
            curve.append({"step": step, "loss_per_head": loss.per_head})
            bar.set_postfix(next_bits=f"{loss.per_head[0] * BITS_PER_NAT:.3f}")
    train_time = time.perf_counter() - t0

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / config["name"]
    save_file({k: v.detach().half().contiguous() for k, v in model.state_dict().items()}, str(path.with_suffix(".safetensors")))
    shipped = MTPModel(cfg)
    shipped.load_state_dict({k: v.float() for k, v in load_file(str(path.with_suffix(".safetensors"))).items()})
    shipped.eval()
    val = fixed_windows(corpus.val, N_VAL_WINDOWS, T + WINDOW_EXTRA)                       # (128, T + 8)
    val_loss = evaluate(shipped, val, T)
    slice_loss = evaluate(shipped, val[:N_SLICE_WINDOWS], T)
    meta = {"name": config["name"], "model": cfg.to_dict(), "train": {**tc, "steps": steps, "precision": precision},
            "params": sum(p.numel() for p in model.parameters()),
            "tokens_seen": steps * B * T, "train_flops_per_token": train_flops_per_token(cfg, T),
            "train_flops": train_flops_per_token(cfg, T) * steps * B * T,
            "train_seconds": train_time, "seconds_per_step": train_time / steps,
            "val_loss_nats": val_loss, "val_next_bits_per_byte": val_loss[0] * BITS_PER_NAT,
            "val_windows": {"n": N_VAL_WINDOWS, "length": T + WINDOW_EXTRA, "of": "corpus.val from byte 0"},
            "val_slice_loss_nats": slice_loss, "val_slice_windows": N_SLICE_WINDOWS,
            "curve": curve, "corpus": corpus.provenance(sdist), "git_commit": _git_commit(),
            "torch": torch.__version__, "python": platform.python_version(), "weights_dtype": "float16"}
    path.with_suffix(".json").write_text(json.dumps(meta, indent=1))
    return meta


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a JSON file under data/mtp/configs/")
    parser.add_argument("--out", default="data/mtp", help="where the checkpoint and its provenance go")
    parser.add_argument("--steps", type=int, default=None, help="override the config's steps (a quick try)")
    args = parser.parse_args(argv)
    meta = train(json.loads(Path(args.config).read_text()), Path(args.out), args.steps)
    print(f"{meta['name']}: val next-token {meta['val_next_bits_per_byte']:.4f} bits/byte, "
          f"{meta['train_seconds']:.0f} s, wrote {args.out}/{meta['name']}.safetensors")


if __name__ == "__main__":
    main()
