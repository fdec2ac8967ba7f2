"""EAGLE-3 heads leave the lab: written in the speculators (vLLM) and SpecForge (SGLang) formats and read back.

The exported tensors are checked against the engines' definition of EAGLE-3's layer (vLLM's
model_executor/models/llama_eagle3.py, speculators' models/eagle3): the names their loaders take, and the
forward computed here from the exported tensors alone, with separate q, k and v projections of
concat(input_layernorm(embedding), hidden_norm(h)), h the residual, the draft vocabulary's LM head and d2t;
it equals labkit's head. Checked by speculators itself where it installs: tests/test_peers.py.
"""
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import save_tiny_checkpoint
from safetensors.torch import load_file, save_file

from labkit import autoregressive_generate
from labkit.cli import main
from labkit.decoding.tree import tree_generate
from labkit.drafters.eagle import EagleDrafter
from labkit.export.eagle3 import export_eagle3
from labkit.models.adapters import layer_taps
from labkit.models.eagle_heads import Eagle3Head, EagleConfig, EagleHead, load_eagle3, save_eagle
from labkit.models.loading import load_model
from labkit.training.eagle_loss import unrolled_logits

LAYERS = (1, 3, 4)                     # the engines' default for an 8-layer target: aux ids (2, 4, 5)


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory):
    """(target directory, head directory, the loaded target, the head, its draft vocabulary): random weights."""
    d = tmp_path_factory.mktemp("export_eagle3")
    save_tiny_checkpoint(d / "target", "qwen2", seed=5, num_hidden_layers=8)
    target = load_model(str(d / "target"), dtype="fp32", backend="reference", progress=False).model
    g = torch.Generator().manual_seed(1)
    draft_vocab = torch.randperm(target.vocab_size, generator=g)[:90].sort().values             # (Vd,)
    cfg = EagleConfig.for_target(target, hidden_dim=96, base_model=str(d / "target"), layers=LAYERS,
                                 draft_vocab_size=draft_vocab.numel())
    torch.manual_seed(0)
    head = Eagle3Head(cfg, target.vocab_size, target.max_seq_len)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.normal_(1.0, 0.1) if p.dim() == 1 else p.normal_(0, 0.15)
        head.lm_head.weight.copy_(target.lm_head.weight[draft_vocab] + 0.05 * torch.randn(90, cfg.dim))
        for p in head.parameters():                       # as save_eagle stores them: bf16 values
            p.copy_(p.bfloat16().float())
    save_eagle(head, draft_vocab, d / "head", {"base_model": str(d / "target"), "ttt_steps": 4})
    return d / "target", d / "head", target, head.eval(), draft_vocab


def rope(x, positions, theta):
    """transformers' rotate-half RoPE on x (B, H, T, hd)."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    ang = positions[:, None].float() * inv[None]                                        # (T, hd/2)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def engine_first_step(state, config, layer, embeds, taps):
    """vLLM's Eagle3 forward on a chain of committed pairs, from the exported tensors: logits over the draft
    vocabulary (T, Vd) and their target ids. embeds (T, D) of x_{t+1}, taps (T, 3D) of position t."""
    c = config.get("transformer_layer_config", config)
    H, Hkv, hd, eps = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rms_norm_eps"]
    theta = c.get("rope_parameters", {}).get("rope_theta", c.get("rope_theta"))
    T = embeds.shape[0]

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    h = F.linear(taps, state["fc.weight"])                                              # (T, D)
    x = torch.cat([norm(embeds, state[f"{layer}input_layernorm.weight"]),
                   norm(h, state[f"{layer}hidden_norm.weight"])], -1)                  # (T, 2D)
    residual = norm(h, state[f"{layer}hidden_norm.weight"]) if config.get("norm_before_residual") else h
    q = F.linear(x, state[f"{layer}self_attn.q_proj.weight"]).view(T, H, hd).transpose(0, 1)
    k = F.linear(x, state[f"{layer}self_attn.k_proj.weight"]).view(T, Hkv, hd).transpose(0, 1)
    v = F.linear(x, state[f"{layer}self_attn.v_proj.weight"]).view(T, Hkv, hd).transpose(0, 1)
    pos = torch.arange(1, T + 1)                           # speculators counts from 1: RoPE sees only differences
    q, k = rope(q, pos, theta), rope(k, pos, theta)
    k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)
    att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(T, H * hd)
    u = residual + F.linear(att, state[f"{layer}self_attn.o_proj.weight"])
    gate, up = (F.linear(norm(u, state[f"{layer}post_attention_layernorm.weight"]),
                         state[f"{layer}mlp.{n}_proj.weight"]) for n in ("gate", "up"))
    a = u + F.linear(F.silu(gate) * up, state[f"{layer}mlp.down_proj.weight"])
    logits = F.linear(norm(a, state["norm.weight"]), state["lm_head.weight"])          # (T, Vd)
    return logits, torch.arange(logits.shape[-1]) + state["d2t"]                       # draft id -> target id


@pytest.mark.parametrize("fmt,layer", [("speculators", "layers.0."), ("specforge", "midlayer.")])
def test_the_export_is_the_engines_eagle3_and_scores_what_labkits_head_scores(eagle3, tmp_path, fmt, layer):
    target_dir, head_dir, target, head, draft_vocab = eagle3
    out = export_eagle3(head_dir, target_dir, tmp_path / fmt, fmt, dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    state = load_file(str(out / "model.safetensors"))
    if fmt == "speculators":                  # the target's embedding, as speculators' save_pretrained writes it
        torch.testing.assert_close(state.pop("embed_tokens.weight"), target.embed_tokens.weight, atol=0, rtol=0)
    D, F_ = 64, 96
    q_dim, kv_dim = 4 * 16, 2 * 16
    assert {k: tuple(v.shape) for k, v in state.items()} == {
        "fc.weight": (D, 3 * D), f"{layer}input_layernorm.weight": (D,), f"{layer}hidden_norm.weight": (D,),
        f"{layer}self_attn.q_proj.weight": (q_dim, 2 * D), f"{layer}self_attn.k_proj.weight": (kv_dim, 2 * D),
        f"{layer}self_attn.v_proj.weight": (kv_dim, 2 * D), f"{layer}self_attn.o_proj.weight": (D, q_dim),
        f"{layer}post_attention_layernorm.weight": (D,), f"{layer}mlp.gate_proj.weight": (F_, D),
        f"{layer}mlp.up_proj.weight": (F_, D), f"{layer}mlp.down_proj.weight": (D, F_), "norm.weight": (D,),
        "lm_head.weight": (90, D), "d2t": (90,), "t2d": (128,)}
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert state["t2d"].nonzero().flatten().tolist() == draft_vocab.tolist()
    assert config["draft_vocab_size"] == 90
    if fmt == "speculators":
        assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3DraftModel"]
        assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
        assert config["speculators_config"]["verifier"]["name_or_path"] == str(target_dir.resolve())
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
        assert not any(config[k] for k in ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual"))
        assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    else:
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    tokens = torch.tensor([[5, 17, 33, 2, 9, 11, 40, 7, 21, 3]])
    taps = layer_taps(target, tokens, target.new_cache(), LAYERS)[..., :3 * D]          # (1, T, 3D)
    theirs, ids = engine_first_step(state, config, layer, target.embed_tokens(tokens[0, 1:]), taps[0, :-1])
    with torch.no_grad():
        ours = unrolled_logits(head, target.embed_tokens, head.lm_head.weight, tokens, taps, steps=1)[0][0]
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
    assert ids[theirs.argmax(-1)].tolist() == draft_vocab[ours.argmax(-1)].tolist()


@pytest.mark.parametrize("fmt", ["speculators", "specforge"])
def test_an_engine_directory_loads_into_labkits_drafter_and_drafts_the_same(eagle3, tmp_path, fmt):
    target_dir, head_dir, target, head, draft_vocab = eagle3
    out = export_eagle3(head_dir, target_dir, tmp_path / fmt, fmt)
    loaded, vocab, config = load_eagle3(out, target)
    assert config["format"] == fmt and config["layers"] == list(LAYERS) and vocab.tolist() == draft_vocab.tolist()
    theirs = loaded.state_dict()
    for k, v in head.state_dict().items():
        torch.testing.assert_close(theirs[k], v, atol=0, rtol=0)
    prompt = torch.tensor([5, 17, 33, 2, 9, 11])
    a = tree_generate(target, EagleDrafter(head, target, draft_vocab, top_k=3, depth=4), prompt, 24, budget=10)
    b = tree_generate(target, EagleDrafter(loaded, target, vocab, top_k=3, depth=4), prompt, 24, budget=10)
    assert a.tokens == b.tokens == autoregressive_generate(target, prompt, 24).tokens
    steps = [(s.proposed, s.parents, s.path) for s in a.trace.steps]
    assert steps == [(s.proposed, s.parents, s.path) for s in b.trace.steps]   # the same trees, judged the same


def test_what_labkits_layer_does_not_compute_is_refused(eagle3, tmp_path):
    target_dir, head_dir, target, _, _ = eagle3
    out = export_eagle3(head_dir, target_dir, tmp_path / "s", "speculators")
    config = json.loads((out / "config.json").read_text())

    def load_with(**change):
        d = tmp_path / "bad"
        d.mkdir(exist_ok=True)
        c = json.loads(json.dumps(config))
        for k, v in change.items():
            if k.startswith("layer_"):
                c["transformer_layer_config"][k.removeprefix("layer_")] = v
            else:
                c[k] = v
        (d / "config.json").write_text(json.dumps(c))
        (d / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())
        return load_eagle3(d, target)

    with pytest.raises(ValueError, match="norm_before_fc"):
        load_with(norm_before_fc=True)
    with pytest.raises(ValueError, match="qwen3 layer"):
        load_with(layer_model_type="qwen3")
    with pytest.raises(ValueError, match="2 layers"):
        load_with(layer_num_hidden_layers=2)
    with pytest.raises(ValueError, match="biases"):
        load_with(layer_attention_bias=True)
    with pytest.raises(ValueError, match="yarn"):
        load_with(layer_rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0})
    with pytest.raises(ValueError, match="three distinct blocks"):
        load_with(eagle_aux_hidden_state_layer_ids=[2, 2, 5])
    with pytest.raises(ValueError, match="speculators mlp_speculator"):
        load_with(speculators_model_type="mlp_speculator")
    # an embedding that is not the target's: a head for another target
    d = tmp_path / "embed"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    save_file({**load_file(str(out / "model.safetensors")), "embed_tokens.weight": torch.randn(128, 64)},
              str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="not the target's"):
        load_eagle3(d, target)
    # EAGLE-1 heads have no engine EAGLE-3 form
    eagle1 = EagleHead(EagleConfig.for_target(target, hidden_dim=32), target.vocab_size)
    save_eagle(eagle1, torch.arange(128), tmp_path / "e1", {"base_model": str(target_dir)})
    with pytest.raises(ValueError, match="carries EAGLE-3 heads"):
        export_eagle3(tmp_path / "e1", target_dir, tmp_path / "o", "speculators")


def test_the_export_command_prints_the_engines_command_lines(eagle3, tmp_path, capsys):
    target_dir, head_dir, _, _, _ = eagle3
    assert main(["export", str(head_dir), "--format", "speculators", "--out", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert f"vllm serve {tmp_path / 's'}\n" in out and '"method": "eagle3"' in out
    assert main(["export", str(head_dir), "--format", "specforge", "--out", str(tmp_path / "g")]) == 0
    out = capsys.readouterr().out
    assert "--speculative-algorithm EAGLE3" in out and f"--speculative-draft-model-path {tmp_path / 'g'}" in out
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    helptext = capsys.readouterr().out
    assert all(f in helptext for f in ("speculators", "specforge", "vllm-medusa"))


def test_an_imported_head_drafts_on_the_packed_path_its_lm_head_read_as_rows(eagle3, tmp_path):
    """On labkit's packed CPU kernels the head's layer runs packed and its LM head stays a tensor the drafter
    reads (EagleDrafter.readout packs those rows once): decoding stays exact and drafts what the reference does."""
    import copy

    from labkit.models.backends import apply_path, check_path
    target_dir, head_dir, target, head, draft_vocab = eagle3
    try:
        check_path("packed", "fp32")
    except ValueError as e:
        pytest.skip(f"no packed path here: {e}")
    packed = apply_path(copy.deepcopy(target), "packed", "fp32")
    loaded, vocab, _ = load_eagle3(export_eagle3(head_dir, target_dir, tmp_path / "s", "speculators"), packed)
    assert isinstance(loaded.lm_head, torch.nn.Linear)
    prompt = torch.tensor([5, 17, 33, 2, 9, 11])
    out = tree_generate(packed, EagleDrafter(loaded, packed, vocab, top_k=3, depth=4), prompt, 24, budget=10)
    ref = tree_generate(target, EagleDrafter(head, target, draft_vocab, top_k=3, depth=4), prompt, 24, budget=10)
    assert out.tokens == ref.tokens == autoregressive_generate(target, prompt, 24).tokens
    assert [len(s.proposed) for s in out.trace.steps] == [len(s.proposed) for s in ref.trace.steps]
