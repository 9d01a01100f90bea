"""FP8 KV-cache layouts, quantisation and index conversion (``sparse_mla.formats``; docs/design.md §4)."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from helpers import make_cache, random_latent_k
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_mla import abs_indices_to_kvcache_indices
from sparse_mla.formats import (
    MODEL1,
    V32,
    dequantize_k_cache,
    gather_dequant_tokens,
    get_layout,
    quantize_k_cache,
    ue8m0_scale,
)

# every finite float8_e4m3fn value (bytes 0x7F and 0xFF are NaN; e4m3fn has no inf)
_ALL_BYTES = torch.arange(256, dtype=torch.int32).to(torch.uint8)
_ALL_VALUES = _ALL_BYTES.view(torch.float8_e4m3fn).float()
E4M3_FINITE = _ALL_VALUES[~torch.isnan(_ALL_VALUES)]


def raw_storage(kc: torch.Tensor) -> torch.Tensor:
    """All bytes of the cache's storage as a flat uint8 tensor (layout-independent view)."""
    u8 = kc.view(torch.uint8) if kc.dtype != torch.uint8 else kc
    return u8.as_strided((u8.untyped_storage().nbytes(),), (1,), 0)


def e4m3_values(n_or_shape, g: torch.Generator) -> torch.Tensor:
    """Random finite e4m3 values (uniform over the 254 finite codes)."""
    pick = torch.randint(
        0, E4M3_FINITE.numel(), n_or_shape if isinstance(n_or_shape, tuple) else (n_or_shape,), generator=g
    )
    return E4M3_FINITE[pick]


# ------------------------------------------------------------------ layouts


def test_layout_constants():
    assert (V32.d_qk, V32.d_nope, V32.d_rope, V32.tile, V32.num_tiles) == (576, 512, 64, 128, 4)
    assert V32.bytes_per_token == 656 and V32.scale_offset == 512 and V32.rope_offset == 528
    assert (MODEL1.d_qk, MODEL1.d_nope, MODEL1.tile, MODEL1.num_tiles) == (512, 448, 64, 7)
    assert MODEL1.bytes_per_token == 584 and MODEL1.data_bytes == 576 and MODEL1.scale_section_bytes == 8
    # MODEL1 block stride is padded up to a multiple of 576 bytes
    for pbs in (1, 2, 3, 63, 64, 72, 128):
        bb = MODEL1.block_bytes(pbs)
        assert bb % 576 == 0 and pbs * 584 <= bb < pbs * 584 + 576
    assert MODEL1.block_bytes(64) == 65 * 576
    assert V32.block_bytes(64) == 64 * 656


def test_get_layout_resolution_and_errors():
    assert get_layout("V32") is V32 and get_layout("v3.2") is V32 and get_layout(576) is V32
    assert get_layout("model1") is MODEL1 and get_layout(512) is MODEL1 and get_layout(MODEL1) is MODEL1
    with pytest.raises(ValueError, match="layout"):
        get_layout("V4")
    with pytest.raises(ValueError, match="layout"):
        get_layout(128)
    with pytest.raises(TypeError, match="layout"):
        get_layout(True)
    with pytest.raises(TypeError, match="layout"):
        get_layout(5.0)


# ------------------------------------------------------------------ the walkthrough's worked example


def test_seed_worked_quantization_example():
    """The walkthrough's step 4.2: a 128-value tile with max |x| = 0.75 -> scale 2^-9 (0.001953); 0.25 -> e4m3 128.0."""
    g = torch.Generator().manual_seed(42)
    k = (torch.rand(1, 1, 1, 576, generator=g) * 1.4 - 0.7).to(torch.bfloat16)  # |x| < 0.7
    k[0, 0, 0, 0] = 0.25
    k[0, 0, 0, 127] = 0.75  # tile 0's max
    kc = quantize_k_cache(k, "V32")
    rec = kc.view(torch.uint8)[0, 0, 0]
    scale0 = struct.unpack("<f", bytes(rec[512:516].tolist()))[0]
    assert scale0 == 2.0**-9 == pytest.approx(0.001953, abs=1e-6)
    assert rec[0:1].view(torch.float8_e4m3fn).float().item() == 128.0
    assert rec[127:128].view(torch.float8_e4m3fn).float().item() == 384.0  # 0.75 * 512
    assert dequantize_k_cache(kc)[0, 0, 0, 0].item() == 0.25


# ------------------------------------------------------------------ V32 bytes


def test_v32_byte_offsets_read_raw():
    nb, pbs = 2, 3
    g = torch.Generator().manual_seed(1)
    k = torch.randn(nb, pbs, 1, 576, generator=g)
    # tile t of every token gets max |x| = 448 * 2^(t-6) exactly, so scale_t = 2^(t-6)
    for t in range(4):
        k[..., t * 128 : (t + 1) * 128] = k[..., t * 128 : (t + 1) * 128].clamp(-400, 400) * 2.0 ** (t - 6)
        k[..., t * 128 + 5] = 448 * 2.0 ** (t - 6)
    k = k.to(torch.bfloat16)
    kc = quantize_k_cache(k, "V32")
    assert kc.shape == (nb, pbs, 1, 656) and kc.dtype == torch.float8_e4m3fn and kc.is_contiguous()
    raw = kc.view(torch.uint8)
    for bi in range(nb):
        for ti in range(pbs):
            rec = bytes(raw[bi, ti, 0].tolist())
            scales = struct.unpack("<4f", rec[512:528])
            assert scales == tuple(2.0 ** (t - 6) for t in range(4))
            nope = torch.frombuffer(bytearray(rec[0:512]), dtype=torch.uint8).view(torch.float8_e4m3fn).float()
            deq = nope * torch.tensor(scales).repeat_interleave(128)
            x = k[bi, ti, 0, :512].float()
            assert torch.all(
                (deq - x).abs() <= x.abs() * 2.0**-4 + torch.tensor(scales).repeat_interleave(128) * 2.0**-10
            )
            rope = torch.frombuffer(bytearray(rec[528:656]), dtype=torch.bfloat16)
            assert torch.equal(rope, k[bi, ti, 0, 512:])


# ------------------------------------------------------------------ MODEL1 bytes


@pytest.mark.parametrize("pbs", [3, 64])
def test_model1_layout_read_raw(pbs):
    nb = 2
    k = random_latent_k(nb, pbs, 512, seed=7)
    kc = quantize_k_cache(k, "MODEL1", out_dtype=torch.uint8)
    bb = MODEL1.block_bytes(pbs)
    assert kc.shape == (nb, pbs, 1, 584)
    assert kc.stride() == (bb, 584, 584, 1)
    assert bb % 576 == 0 and bb >= pbs * 584
    assert kc.untyped_storage().nbytes() == nb * bb
    flat = raw_storage(kc)
    for bi in range(nb):
        blk = flat[bi * bb : (bi + 1) * bb]
        # padding after the scale section is zero
        assert torch.all(blk[pbs * 584 :] == 0)
        for ti in range(pbs):
            rec = blk[ti * 576 : (ti + 1) * 576]
            sc = blk[pbs * 576 + ti * 8 : pbs * 576 + ti * 8 + 8]
            assert sc[7].item() == 0  # pad byte
            exps = sc[:7].to(torch.int32)
            scales = torch.ldexp(torch.ones(7), exps - 127)
            x = k[bi, ti, 0].float()
            amax = x[:448].view(7, 64).abs().amax(-1)
            expect = torch.tensor([2.0 ** math.ceil(math.log2(max(a / 448, 1e-4))) for a in amax.tolist()])
            assert torch.equal(scales, expect)
            nope = rec[:448].clone().view(torch.float8_e4m3fn).float()
            deq = nope * scales.repeat_interleave(64)
            s_el = scales.repeat_interleave(64)
            assert torch.all((deq - x[:448]).abs() <= x[:448].abs() * 2.0**-4 + s_el * 2.0**-10)
            rope = rec[448:576].clone().view(torch.bfloat16)
            assert torch.equal(rope, k[bi, ti, 0, 448:])


def test_model1_dequantize_matches_manual_decode():
    k = random_latent_k(3, 5, 512, seed=11)
    kc = quantize_k_cache(k, "MODEL1")
    deq = dequantize_k_cache(kc, "MODEL1", dtype=torch.float32)
    assert deq.shape == (3, 5, 1, 512)
    assert torch.equal(deq[..., 448:], k[..., 448:].float())
    s = ue8m0_scale(k[..., :448].float().reshape(3, 5, 1, 7, 64).abs().amax(-1)).repeat_interleave(64, -1)
    err = (deq[..., :448] - k[..., :448].float()).abs()
    assert torch.all(err <= k[..., :448].float().abs() * 2.0**-4 + s * 2.0**-10)
    assert (err > 0).any()  # random data does get rounded


# ------------------------------------------------------------------ exactness and error bounds


@pytest.mark.parametrize("layout", ["V32", "MODEL1"])
def test_exact_round_trip_of_fp8_grid_values(layout):
    """Values v * 2^k (v an e4m3 value, k the tile's scale exponent) survive quantisation exactly."""
    lay = get_layout(layout)
    nb, pbs = 2, 4
    g = torch.Generator().manual_seed(3)
    n_tiles = nb * pbs * lay.num_tiles
    v = e4m3_values((n_tiles, lay.tile), g)
    v[:, 0] = torch.where(torch.rand(n_tiles, generator=g) < 0.5, 448.0, -448.0)  # pins scale = 2^k
    kexp = torch.randint(-13, 6, (n_tiles, 1), generator=g)
    nope = torch.ldexp(v, kexp.to(torch.float32).expand_as(v).to(torch.int32))
    rope = torch.randn(nb * pbs, lay.d_rope, generator=g)
    k = torch.cat([nope.view(nb * pbs, lay.d_nope), rope], 1).view(nb, pbs, 1, lay.d_qk).to(torch.bfloat16)
    assert torch.equal(k[..., : lay.d_nope].float().view(n_tiles, lay.tile), nope)  # bf16 holds them exactly
    kc = quantize_k_cache(k, layout)
    deq = dequantize_k_cache(kc, layout, dtype=torch.float32)
    assert torch.equal(deq, k.float())
    assert torch.equal(dequantize_k_cache(kc, layout), k)  # bf16 output is exact too


@pytest.mark.parametrize("layout", ["V32", "MODEL1"])
def test_error_bound_random_data(layout):
    """|x - deq| <= 2^-4 |x| (3 mantissa bits) + scale * 2^-10 (half the e4m3 subnormal step)."""
    lay = get_layout(layout)
    k, kc = make_cache(layout, 4, 16, seed=5)
    x = k.float()
    deq = dequantize_k_cache(kc, layout, dtype=torch.float32)
    tiles = x[..., : lay.d_nope].reshape(4, 16, 1, lay.num_tiles, lay.tile)
    scale = ue8m0_scale(tiles.abs().amax(-1))
    s_el = scale.repeat_interleave(lay.tile, -1)
    err = (deq[..., : lay.d_nope] - x[..., : lay.d_nope]).abs()
    bound = x[..., : lay.d_nope].abs() * 2.0**-4 + s_el * 2.0**-10
    assert torch.all(err <= bound)
    # the bound is not vacuous: the worst relative error of normal values is close to 2^-4
    normal = x[..., : lay.d_nope].abs() >= s_el * 2.0**-6
    rel = (err / x[..., : lay.d_nope].abs().clamp_min(1e-30))[normal]
    assert 2.0**-5 < rel.max().item() <= 2.0**-4
    assert torch.equal(deq[..., lay.d_nope :], x[..., lay.d_nope :])


def test_fp8_subnormals():
    """e4m3 subnormals m * 2^-9 (m = 1..7) are kept exactly; below half the smallest, values flush to 0."""
    k = torch.zeros(1, 1, 1, 576)
    k[..., 0] = 448 * 2.0**-8  # tile 0 scale 2^-8
    sc = 2.0**-8
    for m in range(1, 8):
        k[..., m] = m * 2.0**-9 * sc
        k[..., 10 + m] = -m * 2.0**-9 * sc
    k[..., 20] = 2.0**-11 * sc  # a quarter of the smallest subnormal -> 0
    k[..., 21] = 3 * 2.0**-11 * sc  # 0.75 of the smallest subnormal -> rounds up to it
    g = torch.Generator().manual_seed(9)
    k[..., 512:] = torch.randn(64, generator=g)
    k = k.to(torch.bfloat16)
    kc = quantize_k_cache(k, "V32", out_dtype=torch.uint8)
    raw = kc[0, 0, 0]
    assert raw[1:8].tolist() == list(range(1, 8))  # subnormal codes 0x01..0x07
    assert raw[11:18].tolist() == [0x80 | m for m in range(1, 8)]
    assert raw[20].item() in (0x00, 0x80)
    assert raw[21].item() == 0x01
    deq = dequantize_k_cache(kc, "V32", dtype=torch.float32)[0, 0, 0]
    for m in range(1, 8):
        assert deq[m].item() == m * 2.0**-9 * sc and deq[10 + m].item() == -m * 2.0**-9 * sc
    assert deq[20].item() == 0.0 and deq[21].item() == 2.0**-9 * sc


def test_saturation_at_448():
    """A tile whose amax / scale is exactly 448 stores +-448 (codes 0x7E / 0xFE), never NaN."""
    k = torch.zeros(1, 2, 1, 576)
    g = torch.Generator().manual_seed(13)
    k[..., :512] = torch.randn(1, 2, 1, 512, generator=g).clamp(-3, 3)
    k[0, 0, 0, 3] = 56.0  # 448 * 2^-3: scale 2^-3, stored 448
    k[0, 0, 0, 4] = -56.0
    k[0, 1, 0, 130] = -56.0  # tile 1 of token 1: only the negative extreme
    k[0, 1, 0, 0] = 56.5  # just above 448 * 2^-3 -> scale 2^-2 (stored 226 -> rounds to 224)
    k = k.to(torch.bfloat16)
    kc = quantize_k_cache(k, "V32", out_dtype=torch.uint8)
    raw = kc[0, :, 0]
    sc = raw[:, 512:528].contiguous().view(torch.float32)
    assert sc[0, 0].item() == 2.0**-3 and sc[1, 1].item() == 2.0**-3 and sc[1, 0].item() == 2.0**-2
    assert raw[0, 3].item() == 0x7E and raw[0, 4].item() == 0xFE and raw[1, 130].item() == 0xFE
    nope = raw[:, :512].contiguous().view(torch.float8_e4m3fn).float()
    assert not torch.isnan(nope).any()
    assert nope.abs().max().item() == 448.0
    assert nope[1, 0].item() == 224.0
    deq = dequantize_k_cache(kc, "V32", dtype=torch.float32)
    assert deq[0, 0, 0, 3].item() == 56.0 and deq[0, 0, 0, 4].item() == -56.0


@pytest.mark.parametrize("layout", ["V32", "MODEL1"])
def test_all_zero_tiles(layout):
    """amax 0 -> scale 2^ceil(log2(1e-4)) = 2^-13 and every stored value 0."""
    lay = get_layout(layout)
    g = torch.Generator().manual_seed(17)
    k = torch.randn(1, 2, 1, lay.d_qk, generator=g)
    k[0, 0, 0, : lay.d_nope] = 0.0  # token 0: all tiles zero
    k[0, 1, 0, : lay.tile] = 0.0  # token 1: only the first tile zero
    k = k.to(torch.bfloat16)
    kc = quantize_k_cache(k, layout, out_dtype=torch.uint8)
    assert 2.0 ** math.ceil(math.log2(1e-4)) == 2.0**-13
    if layout == "V32":
        raw = kc[0, :, 0]
        sc = raw[:, 512:528].contiguous().view(torch.float32)
        assert sc[0].tolist() == [2.0**-13] * 4 and sc[1, 0].item() == 2.0**-13
        assert torch.all(raw[0, :512] == 0) and torch.all(raw[1, :128] == 0)
    else:
        flat = raw_storage(kc)
        pbs = 2
        assert flat[pbs * 576 : pbs * 576 + 7].tolist() == [127 - 13] * 7
        assert flat[pbs * 576 + 8].item() == 127 - 13
        assert torch.all(flat[:448] == 0) and torch.all(flat[576 : 576 + 64] == 0)
    deq = dequantize_k_cache(kc, layout, dtype=torch.float32)
    assert torch.all(deq[0, 0, 0, : lay.d_nope] == 0) and torch.all(deq[0, 1, 0, : lay.tile] == 0)
    assert torch.equal(deq[..., lay.d_nope :], k[..., lay.d_nope :].float())


@settings(max_examples=80, deadline=None)
@given(
    st.one_of(
        st.floats(min_value=0.0, max_value=1e6, allow_nan=False, width=32),
        st.integers(-30, 15).map(lambda e: 448.0 * 2.0**e),  # exact powers of two of amax/448
    )
)
def test_ue8m0_scale_matches_formula(amax):
    s = ue8m0_scale(torch.tensor([amax], dtype=torch.float32)).item()
    v = max(float(torch.tensor(amax, dtype=torch.float32) / 448), 1e-4)
    v = float(torch.tensor(v, dtype=torch.float32))  # the clamp happens in float32
    expect = 2.0 ** math.ceil(math.log2(v))
    assert s == expect
    assert amax / s <= 448.0  # never saturates beyond the e4m3 range


# ------------------------------------------------------------------ dtypes and strided views


@pytest.mark.parametrize("layout", ["V32", "MODEL1"])
def test_uint8_and_fp8_outputs_hold_the_same_bytes(layout):
    k = random_latent_k(2, 8, get_layout(layout).d_qk, seed=19)
    a = quantize_k_cache(k, layout, out_dtype=torch.float8_e4m3fn)
    b = quantize_k_cache(k, layout, out_dtype=torch.uint8)
    assert a.dtype == torch.float8_e4m3fn and b.dtype == torch.uint8
    assert a.shape == b.shape and a.stride() == b.stride()
    assert torch.equal(raw_storage(a), raw_storage(b))
    assert torch.equal(dequantize_k_cache(a, layout), dequantize_k_cache(b, layout))
    with pytest.raises(TypeError, match="out_dtype"):
        quantize_k_cache(k, layout, out_dtype=torch.int8)


@pytest.mark.parametrize("out_dtype", [torch.uint8, torch.float8_e4m3fn])
def test_dequantize_strided_view_of_layer_pool_v32(out_dtype):
    """k_cache = pool[:, layer] of a layer-interleaved pool [nb, L, pbs, 1, 656]."""
    nb, L, pbs = 3, 4, 5
    k, kc = make_cache("V32", nb, pbs, seed=23, out_dtype=out_dtype)
    g = torch.Generator().manual_seed(24)
    pool = torch.randint(0, 256, (nb, L, pbs, 1, 656), generator=g, dtype=torch.uint8)
    pool.view(-1)[::97] = 0xFF  # NaN bytes in other layers must not matter
    pool[:, 2] = kc.view(torch.uint8)
    view = pool[:, 2] if out_dtype == torch.uint8 else pool.view(out_dtype)[:, 2]
    assert not view.is_contiguous() and view.stride(0) == L * pbs * 656 and view.storage_offset() > 0
    assert torch.equal(dequantize_k_cache(view, "V32"), dequantize_k_cache(kc, "V32"))
    # and gather of single tokens through the view
    idx = torch.tensor([[0, nb * pbs - 1, 7]])
    assert torch.equal(gather_dequant_tokens(view, "V32", idx), gather_dequant_tokens(kc, "V32", idx))


def test_dequantize_token_interleaved_v32_view():
    """A pool that interleaves layers per token ([nb, pbs, L, 656], view [:, :, l:l+1]) has a token
    stride of L * 656 bytes; dequantisation must honour it (regression: gather used pbs * 656 as
    the block span and indexed past the end)."""
    nb, L, pbs = 3, 3, 4
    _, kc = make_cache("V32", nb, pbs, seed=29, out_dtype=torch.uint8)
    pool = torch.full((nb, pbs, L, 656), 0xFF, dtype=torch.uint8)
    pool[:, :, 2] = kc[:, :, 0]
    view = pool[:, :, 2:3]
    assert view.stride(1) == L * 656
    assert torch.equal(dequantize_k_cache(view, "V32"), dequantize_k_cache(kc, "V32"))


def test_layer_pool_view_model1_is_refused():
    """One layer of a pool interleaving layers by block has the strides of a token slice of a cache
    with larger pages (whose scale rows sit elsewhere): refused, naming the argument."""
    nb, L, pbs, layer = 2, 3, 6, 1
    k, kc = make_cache("MODEL1", nb, pbs, seed=31, out_dtype=torch.uint8)
    bb = MODEL1.block_bytes(pbs)
    pool = torch.full((nb, L, bb), 0xFF, dtype=torch.uint8)
    pool[:, layer] = raw_storage(kc).view(nb, bb)
    view = pool.as_strided((nb, pbs, 1, 584), (L * bb, 584, 584, 1), layer * bb)
    for v in (view, view.view(torch.float8_e4m3fn)):
        with pytest.raises(ValueError, match="^kq: a MODEL1 block of 6 tokens starts every 12096 bytes"):
            dequantize_k_cache(v, "MODEL1")
    layer_copy = pool[:, layer].clone()  # the layer as a cache of its own: padded blocks, accepted
    own = layer_copy.as_strided((nb, pbs, 1, 584), (bb, 584, 584, 1))
    assert torch.equal(dequantize_k_cache(own, "MODEL1"), dequantize_k_cache(kc, "MODEL1"))


# ------------------------------------------------------------------ bad inputs


def test_quantize_bad_inputs():
    good = torch.randn(1, 2, 1, 576).bfloat16()
    with pytest.raises(TypeError, match="^k:"):
        quantize_k_cache(good.tolist(), "V32")
    with pytest.raises(TypeError, match="^k:"):
        quantize_k_cache(good.to(torch.float8_e4m3fn), "V32")
    with pytest.raises(TypeError, match="^k:"):
        quantize_k_cache(torch.zeros(1, 2, 1, 576, dtype=torch.int32), "V32")
    with pytest.raises(ValueError, match="^k:"):
        quantize_k_cache(good, "MODEL1")  # 576 dims for a 512-dim layout
    with pytest.raises(ValueError, match="^k:"):
        quantize_k_cache(good.view(2, 1, 576), "V32")
    with pytest.raises(ValueError, match="^k:"):
        quantize_k_cache(torch.randn(1, 2, 2, 576).bfloat16(), "V32")
    with pytest.raises(ValueError, match="layout"):
        quantize_k_cache(good, "V4")


def test_dequantize_bad_inputs():
    _, kc = make_cache("V32", 2, 4, seed=37)
    with pytest.raises(TypeError, match="^kq:"):
        dequantize_k_cache(kc.float(), "V32")
    with pytest.raises(ValueError, match="^kq:"):
        dequantize_k_cache(kc, "MODEL1")  # 656 bytes per token is not MODEL1
    with pytest.raises(ValueError, match="^kq:"):
        dequantize_k_cache(kc.view(torch.uint8)[..., :600], "V32")
    with pytest.raises(ValueError, match="^kq:"):
        dequantize_k_cache(kc.view(torch.uint8).view(2, 4, 656), "V32")
    # a MODEL1 cache allocated without the 576-byte block padding is fine (3 * 584 = 1752 bytes a
    # block, not a multiple of 576); a block stride below the 1752 bytes a block uses is not
    unpadded = torch.zeros(2, 3, 1, 584, dtype=torch.uint8)
    assert dequantize_k_cache(unpadded, "MODEL1").shape == (2, 3, 1, 512)
    with pytest.raises(ValueError, match="^kq: a MODEL1 block of 3 tokens starts every 1744 bytes"):
        dequantize_k_cache(unpadded.view(-1)[: 2 * 1752 - 8].as_strided((2, 3, 1, 584), (1744, 584, 584, 1)), "MODEL1")
    # byte dim not contiguous
    wide = torch.zeros(2, 4, 1, 656 * 2, dtype=torch.uint8)[..., ::2]
    with pytest.raises(ValueError, match="^kq:"):
        dequantize_k_cache(wide, "V32")


# ------------------------------------------------------------------ abs -> cache indices


def _abs_to_cache_loop(abs_idx, block_table, pbs):
    b, s_q, topk = abs_idx.shape
    nlog = block_table.shape[1]
    out = torch.empty_like(abs_idx, dtype=torch.int32)
    for i in range(b):
        for s in range(s_q):
            for j in range(topk):
                t = int(abs_idx[i, s, j])
                if t < 0 or t // pbs >= nlog:
                    out[i, s, j] = -1
                    continue
                phys = int(block_table[i, t // pbs])
                out[i, s, j] = -1 if phys < 0 else phys * pbs + t % pbs
    return out


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_abs_indices_to_kvcache_indices_vs_loop(dtype):
    g = torch.Generator().manual_seed(41)
    b, s_q, topk, pbs, nlog, nphys = 3, 2, 50, 16, 5, 40
    block_table = torch.stack([torch.randperm(nphys, generator=g)[:nlog] for _ in range(b)]).to(torch.int32)
    block_table[1, 3] = -1  # unmapped logical block
    abs_idx = torch.randint(-1, nlog * pbs + 20, (b, s_q, topk), generator=g).to(dtype)
    abs_idx[0, 0, :3] = torch.tensor([-1, 0, nlog * pbs])  # -1, first token, one past the table
    got = abs_indices_to_kvcache_indices(abs_idx, block_table, pbs)
    assert got.dtype == torch.int32 and got.shape == abs_idx.shape
    assert torch.equal(got, _abs_to_cache_loop(abs_idx, block_table, pbs))
    assert got[0, 0, 0] == -1 and got[0, 0, 2] == -1
    assert got[0, 0, 1] == block_table[0, 0] * pbs
    # the formula on the valid entries
    t = abs_idx.long()
    ok = (t >= 0) & (t < nlog * pbs)
    lb = (t // pbs).clamp(0, nlog - 1)
    phys = torch.gather(block_table.long(), 1, lb.view(b, -1)).view_as(t)
    ok &= phys >= 0
    assert torch.equal(got[ok].long(), (phys * pbs + t % pbs)[ok])
    assert torch.all(got[~ok] == -1)
    assert (~ok).any() and ok.sum() > 100


def test_abs_indices_empty_block_table():
    abs_idx = torch.tensor([[[0, 5, -1]]], dtype=torch.int32)
    got = abs_indices_to_kvcache_indices(abs_idx, torch.zeros(1, 0, dtype=torch.int32), 64)
    assert got.tolist() == [[[-1, -1, -1]]]


def test_abs_indices_bad_inputs():
    idx = torch.zeros(2, 1, 4, dtype=torch.int32)
    bt = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(TypeError, match="abs_indices"):
        abs_indices_to_kvcache_indices(idx.float(), bt, 64)
    with pytest.raises(TypeError, match="abs_indices"):
        abs_indices_to_kvcache_indices([[0]], bt, 64)
    with pytest.raises(TypeError, match="block_table"):
        abs_indices_to_kvcache_indices(idx, bt.float(), 64)
    with pytest.raises(ValueError, match="page_block_size"):
        abs_indices_to_kvcache_indices(idx, bt, 0)
    with pytest.raises(ValueError, match="page_block_size"):
        abs_indices_to_kvcache_indices(idx, bt, 64.0)
    with pytest.raises(ValueError, match="abs_indices"):
        abs_indices_to_kvcache_indices(idx[0], bt, 64)
    with pytest.raises(ValueError, match="block_table"):
        abs_indices_to_kvcache_indices(idx, bt[:1], 64)
    with pytest.raises(ValueError, match="block_table"):
        abs_indices_to_kvcache_indices(idx, bt[0], 64)
