"""The static, compilable decode path (labkit/decoding/static.py) against the model's own forward.

On CPU: the static cache's writes and whole-buffer reads under a mask give the logits of
Transformer.forward; greedy tokens equal the autoregressive baseline's, token for token, eagerly
and when torch.compile traces the step in one graph (backend "eager": dynamo's trace, without
inductor's code generation, which the GPU benchmark scripts/bench_decode.py exercises).
"""
import pytest
import torch
from conftest import host_syncs, tiny_model

from labkit import autoregressive_generate
from labkit.decoding.static import StaticDecoder, static_forward
from labkit.models.kv_cache import StaticKVCache


def test_static_forward_equals_forward_for_prefill_and_steps(tiny_target):
    prompt = torch.tensor([[5, 17, 3, 29, 42, 7]])                           # (1, 6)
    cache = tiny_target.new_cache(max_len=32)
    a = tiny_target.args
    static = StaticKVCache(a.n_layers, 1, a.n_kv_heads, 32, a.head_dim, torch.float32)
    static.slots = torch.arange(6)
    ref, got = tiny_target(prompt, cache), static_forward(tiny_target, static, prompt)  # (1, 6, V)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    for pos, token in enumerate([11, 12, 13], start=6):
        static.slots = torch.tensor([pos])
        ref = tiny_target(torch.tensor([[token]]), cache)                    # (1, 1, V)
        got = static_forward(tiny_target, static, torch.tensor([[token]]))
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # the static cache holds the same keys in the written slots, zeros after them
    torch.testing.assert_close(static.k[:, :, :, :9], cache.k[:, :, :, :9])
    assert static.k[:, :, :, 9:].abs().sum() == 0


@pytest.mark.parametrize("compile", [False, True])
def test_static_greedy_equals_autoregressive(compile):
    model = tiny_model(seed=3)
    prompt = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    ref = autoregressive_generate(model, prompt, max_new_tokens=24).tokens
    dec = StaticDecoder(model, max_len=40, compile=compile, compile_backend="eager")
    run = dec.generate(prompt, max_new_tokens=24)
    assert run.tokens == ref
    trace = run.trace
    assert trace.method == "static" and trace.n_generated == 24 and len(trace.steps) == 24
    assert [s.next_token for s in trace.steps] == ref and trace.verify_time > 0
    assert trace.total_time >= trace.prefill_time + trace.verify_time
    again = dec.generate(prompt[:5], max_new_tokens=10)                      # a second prompt reuses the cache
    assert again.tokens == autoregressive_generate(model, prompt[:5], max_new_tokens=10).tokens



def test_the_static_decoder_steps_like_any_decoder_and_stops_at_eos():
    from labkit.decoding.base import Decoder
    model = tiny_model(seed=3)
    prompt = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    ref = autoregressive_generate(model, prompt, max_new_tokens=12).tokens
    dec = StaticDecoder(model, max_len=40).start(prompt, 12)
    assert isinstance(dec, Decoder) and dec.tokens[-1] == ref[0] and not dec.done     # the prefill's token
    while not dec.done:
        dec.step()
    assert dec.tokens[len(prompt):] == ref and dec.trace.stop_reason == "max_new_tokens"
    assert dec.trace.total_time >= dec.trace.prefill_time + dec.trace.verify_time > 0, "stepping keeps the clock"
    stop = ref[5]
    early = StaticDecoder(model, max_len=40).generate(prompt, 12, eos_token_ids=(stop,))
    assert early.tokens == ref[:ref.index(stop) + 1] and early.trace.stop_reason == "eos"

@pytest.mark.parametrize("read_every", [3, 8])
def test_steps_fed_on_the_device_and_read_in_chunks_equal_autoregressive(read_every):
    """read_every steps back to back, each fed by the last one's greedy token on the device, then read at once: the
    same tokens, one Step each, and an end-of-sequence token in the middle of a chunk ends the output there."""
    model = tiny_model(seed=3)
    prompt = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    ref = autoregressive_generate(model, prompt, max_new_tokens=20).tokens
    dec = StaticDecoder(model, max_len=40, read_every=read_every)
    run = dec.generate(prompt, max_new_tokens=20)
    assert run.tokens == ref and len(run.trace.steps) == 20 and dec.cache.length == len(prompt) + 19
    stop = ref[4]                                                   # the 5th token: inside the first or second chunk
    early = dec.generate(prompt, 20, eos_token_ids=(stop,))
    assert early.tokens == ref[:ref.index(stop) + 1] and early.trace.stop_reason == "eos"
    assert dec.generate(prompt[:5], max_new_tokens=7).tokens == autoregressive_generate(model, prompt[:5], 7).tokens


def test_static_decoder_refuses_what_it_cannot_do(tiny_target):
    with pytest.raises(ValueError, match="cuda_graph=True needs the model on a CUDA device"):
        StaticDecoder(tiny_target, max_len=16, cuda_graph=True)
    dec = StaticDecoder(tiny_target, max_len=16)
    with pytest.raises(ValueError, match="exceed max_len=16"):
        dec.generate(torch.arange(10), max_new_tokens=7)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        StaticDecoder(tiny_target, max_len=tiny_target.max_seq_len + 1)
    with pytest.raises(ValueError, match="pass compile=True"):
        StaticDecoder(tiny_target, max_len=16, compile_options={"coordinate_descent_tuning": True})
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match=f"read_every={bad}: pass the number of tokens"):
            StaticDecoder(tiny_target, max_len=16, read_every=bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and inductor's GPU code need a CUDA device")
@pytest.mark.parametrize("compile, options", [(False, None), (True, None),
                                              (True, {"coordinate_descent_tuning": True})])
def test_cuda_graph_greedy_equals_autoregressive_on_gpu(compile, options):
    model = tiny_model(seed=3).cuda()                                        # fp32: no bf16 rounding ties
    prompt = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    ref = autoregressive_generate(model, prompt, max_new_tokens=24).tokens
    dec = StaticDecoder(model, max_len=40, compile=compile, cuda_graph=True, compile_options=options)
    assert dec.read_every == 8                                               # chunks of 8, read once each
    assert dec.generate(prompt, max_new_tokens=24).tokens == ref
    stop = ref[10]
    assert dec.generate(prompt, 24, eos_token_ids=(stop,)).tokens == ref[:ref.index(stop) + 1]
    dec.start(prompt, 24)
    assert [host_syncs(dec.step) for _ in range(3)] == [1, 1, 1] and dec.tokens[len(prompt):] == ref  # 8 a read
    assert dec.generate(prompt[:5], max_new_tokens=10).tokens == autoregressive_generate(model, prompt[:5], 10).tokens
