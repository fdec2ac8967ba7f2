"""labkit's EAGLE-3 head checked by speculators itself (vLLM's EAGLE-3 format and trainer), in its own interpreter.

Runs where LABKIT_PEERS_PYTHON names an interpreter with speculators installed (`make peers` builds one:
speculators caps transformers below labkit's); skipped elsewhere. The recorded run on the shipped head and the
real target: data/bench/peers/speculators_eagle3.md.
"""
import os

import pytest
import torch
from conftest import save_tiny_checkpoint

from labkit.export.peers import check, summary
from labkit.models.eagle_heads import Eagle3Head, EagleConfig, save_eagle
from labkit.models.loading import load_model

PEER = os.environ.get("LABKIT_PEERS_PYTHON")
pytestmark = pytest.mark.skipif(not PEER, reason="LABKIT_PEERS_PYTHON (an interpreter with speculators) not set: "
                                                 "make peers")


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_speculators_computes_what_labkit_computes_on_the_exported_and_its_own_heads(tmp_path, norm_before_residual):
    save_tiny_checkpoint(tmp_path / "target", "qwen2", seed=5, num_hidden_layers=8)
    target = load_model(str(tmp_path / "target"), dtype="fp32", backend="reference", progress=False).model
    draft_vocab = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(1))[:90].sort().values
    cfg = EagleConfig.for_target(target, hidden_dim=96, base_model=str(tmp_path / "target"), layers=(1, 3, 4),
                                 draft_vocab_size=90, norm_before_residual=norm_before_residual)
    torch.manual_seed(0)
    head = Eagle3Head(cfg, target.vocab_size, target.max_seq_len)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(1.0, 0.1) if p.dim() == 1 else p.normal_(0, 0.15)
    save_eagle(head, draft_vocab, tmp_path / "head", {"base_model": str(tmp_path / "target"), "ttt_steps": 3})
    rows = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (12, 20)]
    work = tmp_path / "work"
    work.mkdir()
    record = check(tmp_path / "head", tmp_path / "target", target, PEER, rows, 3, work)
    for name, r in summary(record).items():
        assert r["compared"] == (11 + 10 + 9) + (19 + 18 + 17)        # every root whose step-k token exists
        assert r["max_rel_diff"] < 1e-4 and r["top1_equal"] == 1.0, (name, r)
