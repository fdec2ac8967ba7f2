"""speculators' side of the EAGLE-3 peer check: run in an environment with speculators installed, not labkit.

    PYTHON speculators_side.py run DIR INPUTS OUT [--verifier TARGET_DIR]
    PYTHON speculators_side.py write DIR INPUTS OUT SEED

`run` loads DIR with speculators' own `Eagle3DraftModel.from_pretrained` (a speculators directory; with
--verifier, a SpecForge one, converted first by speculators' own converter) and runs its training-time-test
forward on the inputs labkit wrote (INPUTS, a torch file: hidden_states (1, n, 3D), the fused blocks' outputs
at positions 0..n-1; input_ids (1, n), the tokens 1..n; steps). `write` first builds a fresh Eagle3DraftModel from DIR's
config, draws its weights (seeded), writes it to DIR/written with `save_pretrained`, and runs that one.
OUT (a torch file): the LM head's logits of every step (steps x (n, Vd)), speculators' own greedy draft ids
(steps x (n,)), its d2t, and the versions. This file imports nothing from labkit, so that what it computes is
speculators' alone.
"""
import sys
from pathlib import Path

import torch


def load(path: str, verifier: str | None):
    """speculators' model of a speculators directory, or of a SpecForge one converted by speculators' converter."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    if verifier is not None:
        import json

        from speculators.convert.entrypoints import convert_model
        config = json.loads((Path(path) / "config.json").read_text())
        converted = Path(path) / "converted"
        convert_model(model=path, verifier=verifier, algorithm="eagle3", output_path=str(converted),
                      eagle_aux_hidden_state_layer_ids=config["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
                      norm_before_residual=config.get("norm_before_residual", False))
        path = str(converted)
    config = Eagle3SpeculatorConfig.from_pretrained(path)
    config.transformer_layer_config._attn_implementation = "eager"           # a dense mask on a CPU
    model = Eagle3DraftModel.from_pretrained(path, config=config, dtype=torch.float32)
    if not has_embedding(path):
        # from_pretrained leaves a missing embedding uninitialised (with transformers 5 it is not NaN, which is
        # what speculators' own loader checks for): load the verifier's with speculators' loader, as it means to
        model._load_verifier_weights(overwrite_embed_tokens=True)
    return model


def has_embedding(path: str) -> bool:
    from safetensors import safe_open
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        return "embed_tokens.weight" in f.keys()


def written(path: str, seed: int):
    """A head made and saved by speculators itself: its own init, norms and LM head drawn around it."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    config = Eagle3SpeculatorConfig.from_pretrained(path)
    config.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel.from_pretrained(path, config=config, dtype=torch.float32)   # + the verifier embedding
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("embed_tokens", "verifier_")):
                continue
            scale = 0.1 if p.dim() == 1 else 0.5 / p.shape[1] ** 0.5
            p.copy_((p if p.dim() > 1 and "lm_head" in name else (torch.ones_like(p) if p.dim() == 1 else 0))
                    + scale * torch.randn(p.shape, generator=g))
    out = Path(path) / "written"
    model.save_pretrained(out)
    return load(str(out), None), out


def main(argv: list[str]) -> None:
    mode, path, inputs, out = argv[:4]
    verifier = argv[argv.index("--verifier") + 1] if "--verifier" in argv else None
    x = torch.load(inputs, weights_only=True)
    if mode == "write":
        model, where = written(path, int(argv[4]))
    else:
        model, where = load(path, verifier), Path(path)
    model = model.float().eval()
    logits = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o[0].detach().clone()))
    n = x["input_ids"].shape[1]
    with torch.no_grad():
        drafts = model(hidden_states=x["hidden_states"].float(), input_ids=x["input_ids"],
                       document_ids=torch.zeros(1, n, dtype=torch.long), ttt_steps=int(x["steps"]))
    hook.remove()
    from importlib.metadata import version
    torch.save({"logits": logits, "draft_ids": [d[0] for d in drafts],
                "d2t": model.d2t.clone() if model.d2t is not None else None, "written": str(where),
                "versions": {name: version(name) for name in ("speculators", "transformers", "torch")}}, out)


if __name__ == "__main__":
    main(sys.argv[1:])
