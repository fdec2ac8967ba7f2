"""labkit's C++ CPU kernels (kernels/cpu) against their torch references.

The kernels build on any x86-64 CPU with AVX2 + FMA and a C++ compiler, so on such a machine
(CI's included) these tests run rather than skip. The AVX2 code is also built and checked on an
AVX-512 machine (-march=haswell), so both vector widths are tested wherever the suite runs.
"""
from __future__ import annotations

import pytest
import torch

from labkit.kernels import cpu

ok, why = cpu.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"labkit's CPU kernels do not build here: {why}")

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def close(a: torch.Tensor, b: torch.Tensor, dtype) -> float:
    """Max |a - b| relative to max |b|."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", [(1, 64, 64), (3, 300, 256), (8, 1000, 96), (13, 65, 130), (64, 192, 512),
                                   (2, 7, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, M, N, K, bias):
    w = rand(N, K, dtype=dtype, scale=0.05)
    b = rand(N, dtype=dtype, seed=1) if bias else None
    x = rand(M, K, dtype=dtype, seed=2)
    y = cpu.packed_linear(x, cpu.pack_linear(w), N, b)
    assert y.shape == (M, N) and y.dtype == dtype
    assert close(y, cpu.linear_ref(x, w, b), dtype) < TOL[dtype]


def test_packed_linear_keeps_leading_dims_and_rejects_a_wrong_width():
    w = rand(40, 64, scale=0.1)
    x = rand(2, 5, 64, seed=3)
    packed = cpu.pack_linear(w)
    assert torch.equal(cpu.packed_linear(x, packed, 40), cpu.packed_linear(x.reshape(10, 64), packed, 40).view(2, 5, 40))
    with pytest.raises(RuntimeError):
        cpu.packed_linear(rand(3, 63), packed, 40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_is_batch_invariant(dtype):
    """Row i of a 37-row product has the same bits as row i computed alone: verify == k single steps."""
    w, b = rand(520, 384, dtype=dtype, scale=0.05), rand(520, dtype=dtype, seed=1)
    x = rand(37, 384, dtype=dtype, seed=4)
    packed = cpu.pack_linear(w)
    together = cpu.packed_linear(x, packed, 520, b)
    alone = torch.cat([cpu.packed_linear(x[i:i + 1], packed, 520, b) for i in range(37)])
    assert torch.equal(together, alone)


def test_packed_weight_unpacks_to_the_original():
    from labkit.models.backends import PackedLinear
    for dtype in (torch.float32, torch.bfloat16):
        linear = torch.nn.Linear(130, 75, dtype=dtype)
        assert torch.equal(PackedLinear(linear).weight, linear.weight.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", [(1, 64, 64), (3, 300, 256), (8, 1000, 96), (13, 65, 160), (64, 48, 512),
                                   (2, 7, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_linear_matches_its_reference(dtype, M, N, K, bias):
    """The kernel's integer group sums and scales against the same arithmetic in float64."""
    qw = cpu.quantize_int4(rand(N, K, scale=0.05))
    b = rand(N, seed=1) if bias else None
    x = rand(M, K, dtype=dtype, seed=2)
    packed, scales = cpu.pack_int4(qw)
    y = cpu.int4_linear(x, packed, scales, N, b)
    assert y.shape == (M, N) and y.dtype == dtype
    assert close(y, cpu.int4_linear_ref(x, qw, b), dtype) < TOL[dtype]
    # and the int8 activations keep it near the dequantized weights' fp32 product (a measured bound, not exact)
    assert close(y, torch.nn.functional.linear(x.float(), qw.dequantize(), b), dtype) < 0.02


def test_int4_quantization_rounds_each_group_to_its_own_range():
    w = rand(40, 96, scale=0.05)
    w[3, :32] = 0.25                                       # a constant group: scale 0, every weight exact
    qw = cpu.quantize_int4(w)
    assert qw.q.dtype == torch.uint8 and int(qw.q.max()) <= 15 and qw.scale.dtype == torch.float16
    err = (qw.dequantize() - w).view(40, 3, 32).abs().amax(-1)                      # (N, G)
    step = qw.scale.float()
    assert (err <= step / 2 * 1.01 + 1e-3 * w.abs().max()).all()                   # half a step (+ fp16 of lo)
    assert torch.equal(qw.dequantize()[3, :32], torch.full((32,), 0.25))
    with pytest.raises(ValueError, match="divisible by 32"):
        cpu.quantize_int4(rand(8, 48))


def test_int4_linear_is_batch_invariant_and_unpacks():
    """Row i of a 37-row product has the same bits as alone; the packed weight unpacks to the dequantized one."""
    from labkit.models.backends import PackedInt4Linear
    linear = torch.nn.Linear(384, 520)
    layer = PackedInt4Linear(linear)
    x = rand(37, 384, dtype=torch.bfloat16, seed=4)
    together = layer(x)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(37)])
    assert torch.equal(together, alone)
    assert torch.equal(layer.weight, cpu.quantize_int4(linear.weight).dequantize().to(torch.bfloat16))
    qw, back = cpu.quantize_int4(linear.weight[:517]), cpu.unpack_int4(*cpu.pack_int4(linear.weight[:517]), 517)
    assert all(torch.equal(a, b) for a, b in zip(qw, back))              # 517 columns: a padded last block
    with pytest.raises(RuntimeError, match="multiple of 32, got 380"):
        cpu.int4_linear(rand(2, 380), layer.packed, layer.scales, 520)


@pytest.mark.parametrize("K", [96, 160, 1536])            # an odd number of groups, and the model's width
def test_int4_amx_tiles_give_the_vector_codes_bits(K):
    """Where the CPU has AMX, calls of 2+ rows run on the tile unit: the same integer sums and fold, so the same bits."""
    kernels = cpu.load()
    if not kernels.int4_amx():
        pytest.skip("this CPU has no AMX (amx_int8), or Linux did not grant the tile state: nothing to compare")
    qw = cpu.quantize_int4(rand(70, K, scale=0.05))
    packed, scales = cpu.pack_int4(qw)
    b = rand(70, seed=1)
    for dtype in (torch.float32, torch.bfloat16):
        for M in (2, 3, 8, 9, 16, 23):
            x = rand(M, K, dtype=dtype, seed=M)
            tiles = cpu.int4_linear(x, packed, scales, 70, b)
            was = kernels.int4_use_amx(False)
            try:
                vectors = cpu.int4_linear(x, packed, scales, 70, b)
            finally:
                kernels.int4_use_amx(was)
            assert torch.equal(tiles, vectors), (dtype, M)
            assert close(tiles, cpu.int4_linear_ref(x, qw, b), dtype) < TOL[dtype]


def causal_mask(T, S):
    """T new tokens at the end of S slots: row i sees slots 0 .. S - T + i."""
    return torch.ones(T, S, dtype=torch.bool).tril(S - T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hd", cpu.HEAD_DIMS)
@pytest.mark.parametrize("H,Hkv,T,S", [(4, 4, 1, 9), (12, 2, 5, 40), (2, 1, 17, 17)])
def test_decode_attention_matches_sdpa(dtype, hd, H, Hkv, T, S):
    q, k, v = rand(2, H, T, hd, dtype=dtype), rand(2, Hkv, S, hd, dtype=dtype, seed=1), rand(2, Hkv, S, hd, dtype=dtype, seed=2)
    mask = causal_mask(T, S)
    assert close(cpu.decode_attention(q, k, v, mask), cpu.attention_ref(q, k, v, mask), dtype) < TOL[dtype] * 2
    assert close(cpu.decode_attention(q, k, v), cpu.attention_ref(q, k, v), dtype) < TOL[dtype] * 2


def test_decode_attention_tree_mask_per_batch_and_a_strided_cache_view():
    """A (B, 1, T, S) mask with holes (a token tree) over the first S slots of a longer cache."""
    q = rand(2, 4, 6, 64)
    k_cache, v_cache = rand(2, 2, 50, 64, seed=1), rand(2, 2, 50, 64, seed=2)
    k, v = k_cache[:, :, :30], v_cache[:, :, :30]                            # views, not contiguous
    g = torch.Generator().manual_seed(5)
    mask = torch.rand(2, 1, 6, 30, generator=g) < 0.5
    mask[..., 0] = True                                                      # every row sees something
    ref = cpu.attention_ref(q, k.contiguous(), v.contiguous(), mask)
    assert close(cpu.decode_attention(q, k, v, mask), ref, torch.float32) < TOL[torch.float32]


def test_decode_attention_is_batch_invariant():
    q, k, v = rand(1, 8, 9, 128), rand(1, 2, 40, 128, seed=1), rand(1, 2, 40, 128, seed=2)
    mask = causal_mask(9, 40)
    together = cpu.decode_attention(q, k, v, mask)
    alone = torch.cat([cpu.decode_attention(q[:, :, i:i + 1], k, v, mask[i:i + 1]) for i in range(9)], 2)
    assert torch.equal(together, alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_pointwise_kernels_match_the_model(dtype):
    x, w = rand(3, 5, 256, dtype=dtype), rand(256, dtype=dtype, seed=1)
    assert close(cpu.rms_norm(x, w, 1e-6), cpu.rms_norm_ref(x, w, 1e-6), dtype) < TOL[dtype] / 2
    gate_up = rand(4, 512, dtype=dtype, seed=2)
    assert close(cpu.silu_mul(gate_up), cpu.silu_mul_ref(gate_up), dtype) < TOL[dtype] / 2
    from labkit.models.layers import rope_cos_sin
    cos, sin = rope_cos_sin(torch.arange(3, 10).view(1, 7), 64, 1e6, dtype)   # (1, 1, 7, 64)
    q = rand(1, 2, 7, 64, dtype=dtype, seed=3)
    assert close(cpu.rope(q, cos, sin), cpu.rope_ref(q, cos, sin), dtype) < TOL[dtype] / 2


def test_the_avx2_build_matches_too():
    """The AVX2 + FMA code (what an AVX2-only CPU runs), built here with -march=haswell."""
    try:
        avx2 = cpu.load("haswell")
    except cpu.KernelsUnavailable as e:
        pytest.skip(str(e))
    assert not avx2.have_bf16_dot()
    for dtype in (torch.float32, torch.bfloat16):
        w, x = rand(200, 160, dtype=dtype, scale=0.05), rand(9, 160, dtype=dtype, seed=1)
        y = avx2.packed_linear(x, avx2.pack_linear(w), 200, None)
        assert close(y, cpu.linear_ref(x, w), dtype) < TOL[dtype]
        q, k, v = rand(1, 4, 3, 64, dtype=dtype), rand(1, 2, 12, 64, dtype=dtype, seed=1), rand(1, 2, 12, 64, dtype=dtype, seed=2)
        att = avx2.decode_attention(q, k, v, causal_mask(3, 12), 64 ** -0.5)
        assert close(att, cpu.attention_ref(q, k, v, causal_mask(3, 12)), dtype) < TOL[dtype] * 2
        qw = cpu.quantize_int4(rand(200, 160, scale=0.05))
        y4 = avx2.int4_linear(x, *cpu.pack_int4(qw), 200, None)                      # vpmaddubsw, no VNNI
        assert not avx2.int4_vnni() and close(y4, cpu.int4_linear_ref(x, qw), dtype) < TOL[dtype]
        for M in (1, 3, 8, 13):                  # this CPU's own code (512-bit VNNI where it has it): the same bits
            xm = rand(M, 160, dtype=dtype, seed=M)
            assert torch.equal(avx2.int4_linear(xm, *cpu.pack_int4(qw), 200, None),
                               cpu.int4_linear(xm, *cpu.pack_int4(qw), 200)), (dtype, M)
    # the int16 partial sums at their largest (every q = 15, every activation 127): widened before they overflow
    w = torch.zeros(16, 160)
    w[:, ::2] = 1.0                                                                  # q = 0 or 15, scale 1/15
    qw, x = cpu.quantize_int4(w), torch.ones(2, 160)
    y4 = avx2.int4_linear(x, *cpu.pack_int4(qw), 16, None)
    assert close(y4, cpu.int4_linear_ref(x, qw), torch.float32) < TOL[torch.float32]     # 80, as fp16's 1/15 rounds
    assert torch.equal(y4, cpu.int4_linear(x, *cpu.pack_int4(qw), 16))


def test_kernels_unavailable_says_why(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    cpu.load.cache_clear()
    try:
        with pytest.raises(cpu.KernelsUnavailable, match="no C\\+\\+ compiler"):
            cpu.load("x86-64-v3")
    finally:
        cpu.load.cache_clear()
