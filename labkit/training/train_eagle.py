"""Train an EAGLE head on the frozen target's features: python -m labkit.training.train_eagle.

With `--kind eagle3` the head is EAGLE-3's (models/eagle_heads.py): it reads the fused outputs of three
target blocks (features extracted with `--layers`), learns from tokens alone, and with
`--ttt-steps K` trains unrolled K steps on its own outputs (training-time test).

Self-distillation as in EAGLE (Li et al. 2024, sec. 4): for every position t of the corpus the
head sees the pair (f_t, x_{t+1}) and must predict the next feature f_{t+1} (smooth-L1
regression) and, through the target's frozen LM head, the target's own greedy token after it
(cross-entropy, weight 0.1). Features and labels come from `features.py` (computed once).

CPU economics: the cross-entropy runs over the *draft vocabulary* (every token the target
produced on the training corpus, a few 10k of 151,936), which is also the vocabulary the drafter
scores at inference. Training runs in fp32 by default: on an AVX2-only CPU bf16 matmuls over many
rows are far slower than fp32. Where the CPU has bf16 dot products (AVX512_BF16, AMX) `--bf16`
autocasts the forward and backward, which halves the bytes each matmul streams (docs/forward-paths.md).

Every run ends with a replay of a greedy chain on the held-out rows (replay.py), recorded in the
head's config.json next to the run: the data curve (data_curve.py) reads those records.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..models.eagle_heads import Eagle3Head, EagleConfig, EagleHead, read_eagle, save_eagle
from ..models.loading import load_model
from .data_curve import tokens_seen
from .eagle_loss import eagle3_loss, eagle_loss, vocab_index
from .features import FeatureSet, default_features_dir, row_range
from .replay import eagle_guesses, replay_heldout

REPLAY_DEPTH = 6                    # the chain depth replayed on held-out text (EagleDrafter's default depth)


def heldout_replay(head, embed, lm_rows, draft_vocab, fs: FeatureSet, kind: str, depth: int = REPLAY_DEPTH) -> dict:
    """{source: tokens per forward and per-step acceptance of a greedy chain `depth` deep} on the held-out rows."""
    tokens, hidden, _ = fs.split("heldout")
    features = fs.taps_of("heldout") if kind == "eagle3" else hidden
    return replay_heldout(fs, lambda r: eagle_guesses(head, embed, lm_rows, draft_vocab, tokens[r],
                                                      features[r].float(), depth))


def provenance(config: dict) -> str:
    """PROVENANCE.md of a saved head, from its config.json: what it is, and every run with its data and result."""
    kind = config.get("kind", "eagle")
    fm = config.get("features", {})
    what = (f"EAGLE-3 head (the reference layer): fc fusing target blocks {config.get('layers')} outputs (3D -> D); "
            f"one decoder layer whose attention reads concat(input_layernorm(embedding), hidden_norm(h)) (2D), h the "
            f"residual{' (normalised: norm_before_residual)' if config.get('norm_before_residual') else ''}, SwiGLU "
            f"width {config['hidden_dim']:,}; RMSNorm; its own LM head over the draft vocabulary, started from the "
            "target's rows; trained on tokens only"
            if kind == "eagle3" else f"EAGLE-1 head (the reference layer of SafeAILab's cnets1.py): a biased fc over "
                                     "concat(embedding, feature), one decoder layer without an input norm (SwiGLU "
                                     f"width {config['hidden_dim']:,}) whose output is the predicted feature, with no "
                                     "final norm; trained to predict the next feature and token")
    lines = [f"# {'EAGLE-3' if kind == 'eagle3' else 'EAGLE'} head for {config['base_model']}", "",
             "Made by `labkit/training/train_eagle.py` (self-distillation on the frozen target's features).", "",
             f"- {what}; {config['parameters'] / 1e6:.2f}M parameters stored in bf16 with the draft vocabulary "
             f"({config['draft_vocab_size']:,} token ids). The target's embedding"
             f"{'' if kind == 'eagle3' else ' and LM head'} {'is' if kind == 'eagle3' else 'are'} shared, frozen "
             "and not stored.",
             f"- Features: {fm.get('model')} computed in {fm.get('dtype')}, {fm.get('seq_len')}-token rows; corpus "
             f"{json.dumps(fm.get('corpus'))}.",
             f"- Training tokens seen, over all runs: **{config.get('tokens_seen', 0):,}**.", "",
             "| run | training rows | training tokens | steps | seconds | TTT steps | held-out replay, tokens per forward |",
             "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(config.get("runs", []), 1):
        rep = ", ".join(f"{src} {v['tokens_per_forward']:.3f}" for src, v in (r.get("replay") or {}).items())
        lines.append(f"| {i} | {r.get('rows') or 'all'} | {r['training_tokens']:,} | {r['steps']} | {r['seconds']:.0f} | "
                     f"{r.get('ttt_steps', 1)} | {rep or '-'} |")
    ho = config.get("heldout", {})
    lines += ["", f"Held out ({ho.get('sequences')} rows, conversations never trained on): token loss {ho.get('cls')}, "
              f"step-0 top-1 {ho.get('top1')}, draft vocabulary covers {ho.get('draft_vocab_coverage')} of the target's "
              f"tokens. The replay (labkit/training/replay.py) is a greedy chain of depth {REPLAY_DEPTH} at every held-out "
              "root.", "",
              "Last command:", "", f"    {config.get('command', '')}", ""]
    return "\n".join(lines)


def resumed(path: Path, kind: str) -> tuple[dict, dict]:
    """(config, weights with "draft_vocab") of the head saved in `path`, to continue training it."""
    config, state = read_eagle(path)
    if config.get("kind", "eagle") != kind:
        raise ValueError(f"--resume: the head in {path} is {config.get('kind')!r}, not {kind!r}: pass --kind "
                         f"{config.get('kind')} or another --out")
    return config, state


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--features", default=None, help="default: <cache>/features/<model>")
    ap.add_argument("--out", default="data/heads/eagle-qwen2.5-coder-1.5b")
    ap.add_argument("--hidden-dim", type=int, default=1024, help="the head's SwiGLU width")
    ap.add_argument("--epochs", type=float, default=4)
    ap.add_argument("--minutes", type=float, default=15, help="wall-clock cap on training")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--cls-weight", type=float, default=0.1, help="weight of the token loss (EAGLE: 0.1)")
    ap.add_argument("--noise", type=float, default=0.0, help="uniform noise on the input features (EAGLE: 0.1)")
    ap.add_argument("--heldout", type=int, default=None,
                    help="sequences held out for evaluation (default: a self-distilled set's held-out conversations)")
    ap.add_argument("--rows", default=None,
                    help="train on these training rows only, A:B (a data curve's slice; with --resume, the new data)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kind", choices=("eagle", "eagle3"), default="eagle",
                    help="eagle: EAGLE-1 (final feature, feature regression); eagle3: fused blocks, tokens only")
    ap.add_argument("--ttt-steps", type=int, default=1,
                    help="EAGLE-3 training-time test: steps the head is unrolled on its own outputs (1: none)")
    ap.add_argument("--bf16", action="store_true",
                    help="bf16 autocast for the training forward and backward (fp32 weights and optimizer): about "
                         "twice as fast where the CPU has bf16 dot products (AVX512_BF16, AMX)")
    ap.add_argument("--norm-before-residual", action="store_true",
                    help="EAGLE-3: the layer's residual is hidden_norm(h) instead of h (speculators' option)")
    ap.add_argument("--resume", action="store_true",
                    help="continue from the head in --out (same kind and layers) on these features: more data, "
                         "not a fresh start; its record of every run and token seen is kept")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)

    target = load_model(args.model, "bf16").model
    fs = FeatureSet(args.features or default_features_dir(args.model), n_heldout=args.heldout)
    tokens, hidden, target_next = fs.split("train")
    subset = row_range(args.rows)
    tokens, hidden, target_next = tokens[subset], hidden[subset], target_next[subset]
    if tokens.shape[0] == 0:
        raise ValueError(f"--rows {args.rows} selects no training rows (there are {fs.n_train})")
    draft_vocab = target_next[:, 1:].unique()                                           # (Vd,) sorted ids
    previous, state, saved_vocab = {}, None, None
    if args.resume:
        previous, state = resumed(Path(args.out), args.kind)
        saved_vocab = state.pop("draft_vocab").long()
        draft_vocab = torch.cat([draft_vocab, saved_vocab]).unique()                   # the union: any order works
        args.hidden_dim = previous["hidden_dim"]
        if previous.get("layers", []) != fs.meta.get("layers", []) and args.kind == "eagle3":
            raise ValueError(f"--resume: the head fuses blocks {previous['layers']}, these features tapped "
                             f"{fs.meta.get('layers')}: extract features with --layers "
                             f"{','.join(map(str, previous['layers']))}")
    vocab_map = vocab_index(draft_vocab, target.vocab_size)
    target_rows = target.lm_head.weight[draft_vocab].detach().float()                   # (Vd, D), frozen
    embed = torch.nn.Embedding.from_pretrained(target.embed_tokens.weight.float(), freeze=True)
    del target.layers                                                                   # only the embedding and LM head are needed
    if args.kind == "eagle3":
        taps = {"train": fs.taps_of("train")[subset], "heldout": fs.taps_of("heldout")}  # (S, T, 3D) each
        cfg = EagleConfig.for_target(target, args.hidden_dim, args.model, layers=fs.meta["layers"],
                                     draft_vocab_size=draft_vocab.numel(),
                                     norm_before_residual=previous.get("norm_before_residual", args.norm_before_residual))
        head = Eagle3Head(cfg, target.vocab_size, fs.meta.get("seq_len", 256)).float().train()
        head.init_lm_head(target_rows)                                                  # starts as the target's rows
        if state is not None:                     # the saved rows where the vocabulary had them, the target's for new ones
            rows = target_rows.clone()
            rows[vocab_map[saved_vocab]] = state["lm_head.weight"].float()
            state["lm_head.weight"] = rows
    else:
        head = EagleHead(EagleConfig.for_target(target, args.hidden_dim, args.model), target.vocab_size,
                         fs.meta.get("seq_len", 256)).float().train()

    def batch_loss(part, tokens, hidden, target_next, rows=slice(None)):
        """(loss, regression loss or None, token loss, top-1 correct, count): at step 0 for EAGLE-3."""
        if args.kind == "eagle":
            return eagle_loss(head, embed, lm_rows, vocab_map, tokens[rows], hidden[rows], target_next[rows],
                              args.cls_weight, noise=args.noise if part == "train" else 0.0)
        r = eagle3_loss(head, embed, lm_rows, vocab_map, tokens[rows], taps[part][rows].float(), target_next[rows],
                        steps=args.ttt_steps)
        return r.loss, None, r.per_step[0], r.correct[0], r.count[0]
    if state is not None:
        head.load_state_dict({k: v.float() for k, v in state.items()})
    lm_rows = head.lm_head.weight if args.kind == "eagle3" else target_rows             # (Vd, D): EAGLE-3's, trained
    n_params = sum(p.numel() for p in head.parameters())
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    steps_per_epoch = math.ceil(tokens.shape[0] / args.batch_size)
    total = max(1, int(args.epochs * steps_per_epoch))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    print(f"EAGLE head: {n_params / 1e6:.1f}M parameters, draft vocabulary {draft_vocab.numel()} tokens, "
          f"{tokens.shape[0]} x {tokens.shape[1]} training tokens, {total} steps planned", flush=True)

    t0, step, curve = time.perf_counter(), 0, []
    g = torch.Generator().manual_seed(args.seed)
    bar = tqdm(total=total, desc="eagle", unit="step")
    while step < total and time.perf_counter() - t0 < args.minutes * 60:
        for rows in torch.randperm(tokens.shape[0], generator=g).split(args.batch_size):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                loss, reg, cls, correct, count = batch_loss("train", tokens, hidden, target_next, rows)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            opt.step()
            sched.step()
            step += 1
            curve.append({"step": step, "loss": round(float(loss.detach()), 4), "reg": None if reg is None else round(reg, 4),
                          "cls": round(cls, 4), "top1": round(correct / count, 4)})
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", cls=f"{cls:.2f}", top1=f"{correct / count:.2f}")
            if step >= total or time.perf_counter() - t0 >= args.minutes * 60:
                break
    bar.close()
    train_seconds = time.perf_counter() - t0

    head.eval()
    h_tokens, h_hidden, h_next = fs.split("heldout")
    with torch.no_grad():                      # in batches: K steps of draft-vocabulary logits per row add up
        parts = [batch_loss("heldout", h_tokens, h_hidden, h_next, r)
                 for r in torch.arange(h_tokens.shape[0]).split(args.batch_size)]
    count = sum(p[4] for p in parts)
    correct = sum(p[3] for p in parts)
    cls = sum(p[2] * p[4] for p in parts) / count
    reg = None if parts[0][1] is None else sum(p[1] * p[4] for p in parts) / count
    replay = heldout_replay(head, embed, lm_rows, draft_vocab, fs, args.kind)
    in_vocab = float((vocab_map[h_next[:, 1:]] >= 0).float().mean())
    print(f"held out: {'' if reg is None else f'reg {reg:.4f}, '}cls {cls:.3f}, top-1 {correct / count:.3f} "
          f"(draft vocabulary covers {in_vocab:.1%} of the target's tokens)")
    meta = {"base_model": args.model, "draft_vocab_size": int(draft_vocab.numel()), "parameters": n_params,
            "train": {"steps": step, "seconds": round(train_seconds, 1), "batch_size": args.batch_size,
                      "lr": args.lr, "bf16_autocast": args.bf16, "noise": args.noise, "cls_weight": args.cls_weight, "seed": args.seed, "epochs_planned": args.epochs,
                      "first": curve[0], "last": curve[-1], "curve": curve[:: max(1, len(curve) // 50)]},
            "ttt_steps": args.ttt_steps,
            "heldout": {"sequences": int(h_tokens.shape[0]), "replay": replay, "reg": None if reg is None else round(reg, 4), "cls": round(cls, 4),
                        "top1": round(correct / count, 4), "draft_vocab_coverage": round(in_vocab, 4)},
            "features": fs.meta, "command": ("python -m labkit.training.train_eagle " + " ".join(argv or [])).replace(str(Path.home()), "~")}
    # every run this head has had, with the tokens it trained on: what the data curve's x axis counts
    this_run = {"features": fs.meta.get("corpus"), "rows": args.rows, "replay": replay, "training_tokens": int(tokens.shape[0] * (tokens.shape[1] - 1)),
                "tokens_processed": int(step * args.batch_size * (tokens.shape[1] - 1)), "steps": step,
                "seconds": round(train_seconds, 1), "ttt_steps": args.ttt_steps}
    meta["runs"] = previous.get("runs", []) + [this_run]
    meta["tokens_seen"] = tokens_seen(meta["runs"])                   # distinct: a rerun over rows adds none
    save_eagle(head, draft_vocab, Path(args.out), meta)
    (Path(args.out) / "PROVENANCE.md").write_text(provenance(json.loads((Path(args.out) / "config.json").read_text())))
    print(f"saved {args.out}")


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
