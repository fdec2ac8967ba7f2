"""Heads leave the lab: Medusa-1 heads written as vLLM's Medusa model and read back.

The exported directory is checked against vLLM's definition of that model (model_executor/models/medusa.py and
transformers_utils/configs/medusa.py): the parameter names its `load_weights` takes, the config fields its
MedusaConfig reads, and its forward, lm_head(x + SiLU(layers[0](x))) per head, computed here from the exported
tensors alone; the result equals labkit's heads on the same hidden states.
"""
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import save_tiny_checkpoint
from safetensors.torch import load_file

from labkit.cli import main
from labkit.export.vllm_medusa import export_vllm_medusa, load_vllm_medusa, target_lm_head
from labkit.models.loading import load_model
from labkit.models.medusa_heads import MedusaHeads, save_medusa


@pytest.fixture(scope="module")
def medusa(tmp_path_factory):
    """(target directory, heads directory, the loaded target, the heads): random, non-zero blocks."""
    d = tmp_path_factory.mktemp("export")
    save_tiny_checkpoint(d / "target", "qwen2", seed=5)
    target = load_model(str(d / "target"), dtype="fp32", backend="reference", progress=False)
    heads = MedusaHeads(target.model.lm_head, n_heads=3)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.1)
    save_medusa(heads, d / "heads", {"base_model": str(d / "target")}, dtype=torch.float32)
    return d / "target", d / "heads", target, heads


def vllm_medusa_logits(state: dict, config: dict, hidden: torch.Tensor) -> list[torch.Tensor]:
    """vLLM's Medusa forward and compute_logits over the exported tensors: per head, its residual block's layers
    (x = x + SiLU(W x + b), num_hidden_layers of them), then the one LM head (original_lm_head)."""
    out = []
    for k in range(config["num_heads"]):
        x = hidden
        for j in range(config["num_hidden_layers"]):
            x = x + F.silu(F.linear(x, state[f"blocks.{k}.layers.{j}.weight"], state[f"blocks.{k}.layers.{j}.bias"]))
        out.append(F.linear(x, state["lm_head.weight"]))
    return out


def test_the_export_is_vllms_medusa_and_scores_what_labkits_heads_score(medusa, tmp_path):
    target_dir, heads_dir, target, heads = medusa
    out = export_vllm_medusa(heads_dir, target_dir, tmp_path / "vllm", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    state = load_file(str(out / "model.safetensors"))
    # what vLLM's Medusa builds and loads: these parameters, no other
    assert set(state) == {f"blocks.{k}.layers.0.{p}" for k in range(3) for p in ("weight", "bias")} | {
        "lm_head.weight"}
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    assert (config["hidden_size"], config["vocab_size"], config["num_heads"]) == (64, 128, 3)
    assert config["original_lm_head"] and config["medusa_fc_bias"] and config["num_hidden_layers"] == 1
    assert config["truncated_vocab_size"] == config["vocab_size"]               # no token_map
    # MedusaConfig.from_pretrained renames every key holding "num" and "heads" to num_heads: only one may
    assert [k for k in config if "num" in k and "heads" in k] == ["num_heads"]
    assert torch.equal(state["lm_head.weight"], target_lm_head(target_dir))
    hidden = torch.randn(5, 64)
    theirs = vllm_medusa_logits(state, config, hidden)
    ours = heads(hidden)                                                          # (K, 5, V)
    for k in range(3):
        torch.testing.assert_close(theirs[k], ours[k], rtol=1e-5, atol=1e-5)
        assert torch.equal(theirs[k].argmax(-1), ours[k].argmax(-1))


def test_a_vllm_medusa_directory_loads_back_into_labkits_drafter(medusa, tmp_path):
    target_dir, heads_dir, target, heads = medusa
    out = export_vllm_medusa(heads_dir, target_dir, tmp_path / "bf16")              # the default: bf16
    back = load_vllm_medusa(out, target.model.lm_head)
    hidden = torch.randn(4, 64)
    torch.testing.assert_close(back(hidden), heads(hidden), rtol=0.02, atol=0.02)  # bf16 weights
    config = json.loads((out / "config.json").read_text())
    for change, message in (({"num_hidden_layers": 2}, "2 residual layers"),
                            ({"original_lm_head": False}, "an LM head each"),
                            ({"truncated_vocab_size": 64}, "truncated vocabulary"),
                            ({"model_type": "eagle"}, "not vLLM's medusa"),
                            ({"hidden_size": 32}, "hidden size 32")):
        (out / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            load_vllm_medusa(out, target.model.lm_head)
    (out / "config.json").write_text(json.dumps(config))
    other = load_model(str(target_dir), dtype="fp32", backend="reference", progress=False)
    with torch.no_grad():
        other.model.lm_head.weight.mul_(2)
    with pytest.raises(ValueError, match="not this target's"):
        load_vllm_medusa(out, other.model.lm_head)


def test_the_export_command_prints_vllms_command_line(medusa, tmp_path, capsys):
    target_dir, heads_dir, _, _ = medusa
    assert main(["export", str(heads_dir), "--format", "vllm-medusa", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert f"vllm serve {target_dir} --speculative-config" in out and '"method": "medusa"' in out
    assert '"num_speculative_tokens": 3' in out and (tmp_path / "o" / "model.safetensors").is_file()
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    assert "vllm-medusa" in capsys.readouterr().out
