"""read_back: a compiled step's results, read in one sync, handed back by name with their types."""
import torch

from labkit.decoding.host_sync import read_back


def test_read_back_names_each_part_and_keeps_ints_ints_and_floats_floats():
    got = read_back(n_accepted=torch.tensor([2]), keep_rows=torch.tensor([0, 3, 5]),
                    nodes=torch.tensor([151_645, 7, -1, -1]), q_token=torch.tensor([0.25, 0.5], dtype=torch.bfloat16))
    assert got.n_accepted == [2] and got.keep_rows == [0, 3, 5] and got.nodes == [151_645, 7, -1, -1]
    assert got.q_token == [0.25, 0.5] and all(isinstance(v, float) for v in got.q_token)
    assert all(isinstance(v, int) for v in got.nodes)
    assert vars(read_back(empty=torch.zeros(0, dtype=torch.long), one=torch.tensor(3))) == {"empty": [], "one": [3]}
