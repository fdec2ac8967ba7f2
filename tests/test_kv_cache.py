"""The cache's rollback methods: truncate for chains, commit_path for trees."""
import pytest
import torch

from labkit import KVCache


def filled(n: int) -> KVCache:
    cache = KVCache(n_layers=2, batch_size=1, n_kv_heads=1, max_len=16, head_dim=3, dtype=torch.float32)
    for layer in range(2):
        slots = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1).expand(1, 1, n, 3)   # slot s holds s
        cache.write(layer, slots + 100 * layer, -slots)
    cache.advance(n)
    return cache


def test_truncate_then_overwrite():
    cache = filled(6)
    cache.truncate(4)
    assert cache.length == 4 and cache.room() == 12
    k, v = cache.write(0, torch.full((1, 1, 1, 3), 42.0), torch.zeros(1, 1, 1, 3))
    assert k.shape[2] == 5 and k[0, 0, 4, 0] == 42 and k[0, 0, 3, 0] == 3
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(7)


def test_commit_path_keeps_the_accepted_nodes_in_order():
    cache = filled(8)                           # slots 0..2 prefix, 3..7 tree nodes 0..4
    cache.commit_path(torch.tensor([0, 2, 4]), start=3)
    assert cache.length == 6
    assert cache.k[0, 0, 0, :6, 0].tolist() == [0, 1, 2, 3, 5, 7]
    assert cache.k[1, 0, 0, :6, 0].tolist() == [100, 101, 102, 103, 105, 107]
    assert cache.v[0, 0, 0, :6, 0].tolist() == [0, -1, -2, -3, -5, -7]


@pytest.mark.parametrize("keep", [[0], [0, 1, 2], [0, 1, 3]])
def test_commit_path_of_nodes_already_in_place_keeps_every_slot_as_the_copy_would(keep):
    """A plain step (the root alone) or a chain's prefix is already in place: no copy, the same cache."""
    fast, copied = filled(8), filled(8)
    fast.commit_path(torch.tensor(keep), start=3)
    src = 3 + torch.tensor(keep)                                       # what the copy does, spelled out
    copied.k[:, :, :, 3:3 + len(keep)] = copied.k.index_select(3, src)
    copied.v[:, :, :, 3:3 + len(keep)] = copied.v.index_select(3, src)
    assert fast.length == 3 + len(keep)
    assert torch.equal(fast.k[:, :, :, :fast.length], copied.k[:, :, :, :fast.length])
    assert torch.equal(fast.v[:, :, :, :fast.length], copied.v[:, :, :, :fast.length])


def test_nothing_reads_a_slot_before_it_is_written(tiny_target, tiny_draft, monkeypatch):
    """The cache's buffers are left unset (KVCache): filled with NaN instead, every loop and path still decodes the
    same tokens, so no attention, rollback or copy reads a slot no token has written."""
    import copy

    from labkit import DraftModelDrafter, autoregressive_generate, speculative_generate
    from labkit.decoding.tree import tree_generate
    from labkit.drafters import OpeningCopied, Windowed
    from labkit.models.backends import apply_path

    prompt = torch.tensor([3, 14, 15, 9, 2, 6])
    packed = apply_path(copy.deepcopy(tiny_target), "packed", "fp32")
    drafter = lambda: DraftModelDrafter(OpeningCopied(tiny_draft, prompt[:3]))    # noqa: E731
    runs = {"plain": lambda: autoregressive_generate(tiny_target, prompt, 30).tokens,
            "packed": lambda: autoregressive_generate(packed, prompt, 30).tokens,
            "chain": lambda: speculative_generate(tiny_target, drafter(), prompt, 30, 4).tokens,
            "window": lambda: speculative_generate(tiny_target, DraftModelDrafter(Windowed(tiny_draft, 4)), prompt,
                                                   30, 3).tokens,
            "tree": lambda: tree_generate(tiny_target, drafter(), prompt, 30, budget=4).tokens}
    clean = {name: run() for name, run in runs.items()}
    init = KVCache.__init__

    def poisoned(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.k.fill_(float("nan"))
        self.v.fill_(float("nan"))
    monkeypatch.setattr(KVCache, "__init__", poisoned)
    assert {name: run() for name, run in runs.items()} == clean
    assert clean["chain"] == clean["plain"] == clean["tree"]
