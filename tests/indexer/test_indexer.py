"""The DSA lightning indexer: the key cache write (byte-identical to its twin), prefill and paged
logits (kernels vs twins, twins vs the definition), the top-k and its tie rule, the slot ids it
hands to the sparse decode, and argument validation. Kernels run compiled on CUDA and under
Triton's interpreter on the CPU."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
from helpers import GPU_TARGET, check_decode_close, triton_interpret_enabled
from hypothesis import given, settings
from hypothesis import strategies as st

import sparse_mla as flash_mla
from sparse_mla.indexer.reference import (
    dequantize_indexer_cache,
    fp8_mqa_logits_reference,
    fp8_paged_mqa_logits_reference,
    indexer_k_quant_and_cache_reference,
    topk_indices_reference,
)
from sparse_mla.kvcache.reference import abs_indices_to_kvcache_indices
from sparse_mla.reference import sparse_decode_reference
from sparse_mla.testing import abs_e4m3, abs_index_cache, indexer_logits_closeness, same_index_sets

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
KERNELS = ON_GPU or triton_interpret_enabled()
needs_kernels = pytest.mark.skipif(not KERNELS, reason="kernels need CUDA or TRITON_INTERPRET=1")


def empty_cache(num_blocks, block_size, d, fill=0xAB):
    return torch.full((num_blocks, block_size, 1, d + 4), fill, dtype=torch.uint8, device=DEVICE)


def random_keys(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, d, generator=g) * 10.0 ** (torch.rand(n, 1, generator=g) * 6 - 4)  # 1e-4 .. 1e2
    k[0] = 0.0  # amax below the 1e-4 floor
    k[1, 0] = 448.0 * 2.0**-3  # amax / 448 exactly a power of two
    return k.to(torch.bfloat16).to(DEVICE)


def fill_cache(num_blocks, block_size, d, seed, scale_fmt="ue8m0"):
    """A cache with every slot written (random keys, shuffled slots): (cache, keys in slot order)."""
    n = num_blocks * block_size
    k = random_keys(n, d, seed)
    cache = empty_cache(num_blocks, block_size, d)
    flash_mla.indexer_k_quant_and_cache(k, cache, torch.arange(n, device=DEVICE), scale_fmt)
    return cache, k


# FP8 tensor-core dots: compiled on sm_89+ (head_dim >= 32), bound in docs/design.md section 6
FP8_TC = ON_GPU and GPU_TARGET.fp8_dot


def close_to(got, want, magnitude, d=128):
    """:func:`sparse_mla.testing.indexer_logits_closeness` (``magnitude``: the twin on |q|, |k|,
    |w|), asserted; the FP8 tensor-core bound where the kernels take e4m3 dots (head_dim >= 32)."""
    ok, _, worst = indexer_logits_closeness(got, want, magnitude, FP8_TC and d >= 32)
    assert ok, worst


def random_q(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2).to(torch.float8_e4m3fn).to(DEVICE)


# ------------------------------------------------------------------------------ the key cache


@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
@pytest.mark.parametrize("d, block_size", [(128, 64), (64, 16), (32, 7)])
def test_quant_and_cache_matches_twin_bytes(scale_fmt, d, block_size):
    n, nb = 40, 9
    k = random_keys(n, d, seed=d + block_size)
    slots = torch.randperm(nb * block_size)[:n].to(DEVICE)
    slots[3] = -1  # padding: skipped
    slots[5] = nb * block_size + 2  # out of range: skipped
    a, b = empty_cache(nb, block_size, d), empty_cache(nb, block_size, d)
    flash_mla.indexer_k_quant_and_cache(k, a, slots, scale_fmt)
    indexer_k_quant_and_cache_reference(k, b, slots, scale_fmt)
    assert torch.equal(a, b)
    # the definition: power-of-two (or amax/448) scales, values within e4m3's rounding of k
    keys, scales = dequantize_indexer_cache(a)
    ok = (slots >= 0) & (slots < nb * block_size)
    got = keys[slots[ok]] * scales[slots[ok]].unsqueeze(1)
    want = k[ok].float()
    amax = want.abs().amax(1).clamp(min=1e-4)
    if scale_fmt == "ue8m0":
        s = scales[slots[ok]]
        assert torch.equal(torch.frexp(s)[0], torch.full_like(s, 0.5))  # powers of two
        assert ((s >= amax / 448) & (s < 2 * amax / 448)).all()
    assert ((got - want).abs() <= want.abs() / 16 + amax.unsqueeze(1) / 448 * 2.0**-9 * 1.01).all()
    # slots not written keep their bytes
    written = torch.zeros(nb * block_size, dtype=torch.bool, device=DEVICE)
    written[slots[ok]] = True
    data = a.reshape(nb, -1)[:, : block_size * d].reshape(nb * block_size, d)
    assert (data[~written] == 0xAB).all() and (data[written] != 0xAB).any()


@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_non_finite_keys_are_stored_as_nan(scale_fmt):
    d = 16
    k = torch.ones(4, d, dtype=torch.bfloat16, device=DEVICE)
    k[0, 0] = float("nan")
    k[1, 3] = float("inf")
    k[2, 5] = float("-inf")
    a, b = empty_cache(1, 4, d), empty_cache(1, 4, d)
    slots = torch.arange(4, device=DEVICE)
    flash_mla.indexer_k_quant_and_cache(k, a, slots, scale_fmt)
    indexer_k_quant_and_cache_reference(k, b, slots, scale_fmt)
    assert torch.equal(a, b)
    keys, scales = dequantize_indexer_cache(a)
    assert torch.isnan(scales[:3]).all() and torch.isnan(keys[:3]).all() and torch.isfinite(keys[3] * scales[3]).all()


def test_skipped_slots_are_untouched():
    nb, bs, d = 3, 4, 32
    cache = empty_cache(nb, bs, d)
    before = cache.clone()
    k = random_keys(3, d, seed=1)
    flash_mla.indexer_k_quant_and_cache(k, cache, torch.tensor([-1, 12, 1 << 40], device=DEVICE))
    assert torch.equal(cache, before)
    flash_mla.indexer_k_quant_and_cache(k, cache, torch.tensor([-1, 5, -7], device=DEVICE))
    changed = (cache != before).reshape(nb, -1)
    data_bytes = changed[:, : bs * d].reshape(nb, bs, d).any(-1)
    scale_bytes = changed[:, bs * d :].reshape(nb, bs, 4).any(-1)
    assert data_bytes.nonzero().tolist() == [[1, 1]] and scale_bytes.nonzero().tolist() == [[1, 1]]


# ------------------------------------------------------------------------------ logits


def test_references_match_the_definition():
    # one query head and key at a time, in float64
    d, h = 32, 3
    cache, _ = fill_cache(4, 8, d, seed=2)
    keys, scales = dequantize_indexer_cache(cache)
    q = random_q((2, 2, h, d), seed=3)
    w = torch.randn(4, h, device=DEVICE)
    ctx = torch.tensor([13, 1], dtype=torch.int32, device=DEVICE)
    table = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32, device=DEVICE)
    got = fp8_paged_mqa_logits_reference(q, cache, w, ctx, table, 16)
    for i in range(2):
        for p in range(2):
            for j in range(16):
                visible = j < ctx[i] and j <= ctx[i] - 2 + p
                if not visible:
                    assert got[i * 2 + p, j] == float("-inf")
                    continue
                slot = int(table[i, j // 8]) * 8 + j % 8
                want = sum(
                    float(w[i * 2 + p, hh])
                    * max(float(q[i, p, hh].double() @ keys[slot].double()) * float(scales[slot]), 0.0)
                    for hh in range(h)
                )
                assert abs(float(got[i * 2 + p, j]) - want) <= 1e-5 * (1 + abs(want))
    # the prefill logits on the same keys laid out contiguously agree
    flat = torch.stack([keys[int(table[0, j // 8]) * 8 + j % 8] for j in range(16)]).to(torch.float8_e4m3fn)
    fs = torch.stack([scales[int(table[0, j // 8]) * 8 + j % 8] for j in range(16)])
    ks = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    ke = torch.tensor([12, 13], dtype=torch.int32, device=DEVICE)
    pre = fp8_mqa_logits_reference(q[0], flat, fs, w[:2], ks, ke)
    torch.testing.assert_close(pre, got[:2], rtol=1e-6, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("h, d", [(1, 32), (16, 64), (64, 128), (20, 16)])
def test_mqa_logits_kernel_matches_twin(h, d):
    s_q, s_kv = 9, 150
    q = random_q((s_q, h, d), seed=h)
    kv = random_q((s_kv, d), seed=d)
    sc = torch.rand(s_kv, device=DEVICE) + 0.1
    w = torch.randn(s_q, h, device=DEVICE)
    ks = torch.tensor([0, 5, 100, 30, 149, 0, 60, 64, 10], dtype=torch.int32, device=DEVICE)
    ke = torch.tensor([150, 70, 100, 31, 150, 0, 129, 128, 11], dtype=torch.int32, device=DEVICE)  # empty rows 2, 5
    got = flash_mla.fp8_mqa_logits(q, (kv, sc), w, ks, ke)
    want = fp8_mqa_logits_reference(q, kv, sc, w, ks, ke)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    close_to(got, want, fp8_mqa_logits_reference(abs_e4m3(q), abs_e4m3(kv), sc, w.abs(), ks, ke), d=d)
    assert torch.isneginf(got[2]).all() and torch.isneginf(got[5]).all()


@needs_kernels
@pytest.mark.parametrize("next_n, h, d, block_size", [(1, 64, 128, 64), (2, 16, 64, 16), (3, 5, 32, 7)])
def test_paged_logits_kernel_matches_twin(next_n, h, d, block_size):
    b, nb = 4, 40
    cache, _ = fill_cache(nb, block_size, d, seed=next_n + h)
    q = random_q((b, next_n, h, d), seed=5)
    w = torch.randn(b * next_n, h, device=DEVICE)
    ctx = torch.tensor([0, next_n - 1, 5 * block_size + 3, 9 * block_size], dtype=torch.int32, device=DEVICE)
    table = torch.randint(0, nb, (b, 12), dtype=torch.int32, generator=torch.Generator().manual_seed(h)).to(DEVICE)
    table[2, 7:] = -5  # garbage past the context
    table[3, 2] = nb + 7  # an invalid block inside the context: its keys are -inf, never read
    meta = flash_mla.get_paged_mqa_logits_metadata(ctx.cpu(), block_size, 132)
    max_len = 10 * block_size + 5
    got = flash_mla.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, max_len)
    want = fp8_paged_mqa_logits_reference(q, cache, w, ctx, table, max_len)
    assert got.shape == (b * next_n, max_len)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    close_to(
        got,
        want,
        fp8_paged_mqa_logits_reference(abs_e4m3(q), abs_index_cache(cache), w.abs(), ctx, table, max_len),
        d=d,
    )
    assert torch.isneginf(got[:next_n]).all()  # empty context
    assert torch.isneginf(got[3 * next_n :, 2 * block_size : 3 * block_size]).all()


@needs_kernels
def test_nan_in_unused_cache_slots_never_reaches_the_logits():
    nb, bs, d = 8, 16, 64
    cache, _ = fill_cache(nb, bs, d, seed=7)
    table = torch.tensor([[3, 5, 1]], dtype=torch.int32, device=DEVICE)
    for blk in set(range(nb)) - {3, 5, 1}:
        cache[blk] = 0x7F  # e4m3 NaN bytes and NaN scales
    q = random_q((1, 2, 8, d), seed=8)
    w = torch.randn(2, 8, device=DEVICE)
    ctx = torch.tensor([40], dtype=torch.int32, device=DEVICE)
    got = flash_mla.fp8_paged_mqa_logits(
        q, cache, w, ctx, table, flash_mla.get_paged_mqa_logits_metadata(ctx, bs, 1), 64
    )
    assert not torch.isnan(got).any() and torch.isfinite(got[:, :39]).all() and torch.isneginf(got[:, 41:]).all()


def _poison_slot(cache, slot, data_byte, scale):
    """Overwrite one slot of an indexer cache: every e4m3 byte ``data_byte`` and the fp32 ``scale``."""
    nb, bs, _, last = cache.shape
    d = last - 4
    blk, off = divmod(slot, bs)
    flat = cache.view(nb, bs * last)
    flat[blk, off * d : (off + 1) * d] = data_byte
    flat[blk, bs * d + 4 * off : bs * d + 4 * off + 4] = torch.tensor([scale]).view(torch.uint8).to(cache.device)


# (data byte, scale) written past the context: e4m3 NaN bytes with a NaN scale (what the store writes
# for a NaN key), NaN bytes of both signs with a unit scale, zero bytes with an inf scale (0 · inf =
# NaN), finite bytes with +-inf and NaN scales
_POISON = [(0x7F, float("nan")), (0xFF, 1.0), (0x00, float("inf")), (0x38, float("inf")), (0x7F, 1.0),
           (0x38, float("nan")), (0xB8, float("-inf"))]  # fmt: skip


@needs_kernels
@pytest.mark.parametrize(
    "next_n, block_size, num_sms, cfg",
    [(2, 64, 132, None), (2, 16, 1, None), (3, 7, 2, None), (1, 32, 1, None),
     (2, 64, 1, {"fp8_dot": True, "tma": True}), (2, 32, 1, {"fp8_dot": True, "tma": False, "block_n": 32})],
)  # fmt: skip
def test_non_finite_bytes_past_the_context_in_the_last_page_never_reach_the_logits(next_n, block_size, num_sms, cfg):
    # the last, partly filled page of each request holds NaN / inf bytes and scales in its slots
    # at and past context_lens (a key tile holds them beside visible keys): the visible logits are
    # the twin's, everything past the last visible key is -inf, no NaN anywhere; the public call
    # (clean_logits either way) and the FP8-dot pointer and tensor-memory paths (forced: the
    # interpreter runs them; it reads e4m3 NaN bytes as +-480 there, which must not leak either)
    from sparse_mla.indexer.kernels import launch_paged_mqa_logits

    b, h, d, nb = 3, 8, 64, 14
    cache, _ = fill_cache(nb, block_size, d, seed=block_size + next_n)
    table = torch.randperm(nb, generator=torch.Generator().manual_seed(block_size))[: b * 4].view(b, 4)
    table = table.int().to(DEVICE)
    ctx_list = [2 * block_size + 1, max(block_size - 3, next_n), 3 * block_size + block_size // 2]
    ctx = torch.tensor(ctx_list, dtype=torch.int32, device=DEVICE)
    poisoned = 0
    for i, c in enumerate(ctx_list):
        page, first = divmod(c, block_size)
        if first == 0:
            continue
        for off in range(first, block_size):  # the slots of the last page past the context
            slot = int(table[i, page]) * block_size + off
            _poison_slot(cache, slot, *_POISON[(off + i) % len(_POISON)])
            poisoned += 1
    keys, scales = dequantize_indexer_cache(cache)
    assert poisoned > block_size and int((~torch.isfinite(keys * scales.unsqueeze(1)).all(1)).sum()) == poisoned
    q = random_q((b, next_n, h, d), seed=block_size * 3 + next_n)
    w = torch.randn(b * next_n, h, device=DEVICE)
    max_len = 4 * block_size
    want = fp8_paged_mqa_logits_reference(q, cache, w, ctx, table, max_len)
    mag = fp8_paged_mqa_logits_reference(abs_e4m3(q), abs_index_cache(cache), w.abs(), ctx, table, max_len)
    if cfg is None:
        meta = flash_mla.get_paged_mqa_logits_metadata(ctx.cpu(), block_size, num_sms)
        outs = [
            flash_mla.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, max_len, clean) for clean in (False, True)
        ]
    else:
        outs = [torch.full((b * next_n, max_len), 7.0, device=DEVICE)]
        launch_paged_mqa_logits(q.view(torch.uint8), cache, w, ctx, table, outs[0], max_len, num_sms, config=cfg)
    assert not torch.isnan(want).any()
    for got in outs:
        assert not torch.isnan(got).any() and torch.equal(torch.isinf(got), torch.isinf(want))
        close_to(got, want, mag, d=d)
        for i, c in enumerate(ctx_list):
            for p in range(next_n):
                seen = min(c - next_n + p + 1, c)
                row = got[i * next_n + p]
                assert torch.isfinite(row[:seen]).all() and torch.isneginf(row[seen:]).all()


@needs_kernels
@pytest.mark.parametrize("clean_logits", [True, False])
@pytest.mark.parametrize("h, d, cfg", [(8, 64, None), (5, 32, None), (4, 32, {"fp8_dot": True, "block_n": 32})])
def test_non_finite_keys_outside_the_range_never_reach_the_logits(clean_logits, h, d, cfg):
    # NaN / inf keys (NaN bytes, NaN and inf scales, zero bytes times an inf scale) at positions no
    # query's [ks, ke) holds, in the same key tiles as keys that are in range: the logits in range
    # are the twin's (no NaN), outside -inf (clean_logits; the kernels write -inf there either way)
    from sparse_mla.indexer.kernels import launch_mqa_logits

    s_q, s_kv = 7, 200
    q = random_q((s_q, h, d), seed=h + d)
    kv = random_q((s_kv, d), seed=d + 1)
    sc = torch.rand(s_kv, device=DEVICE) + 0.1
    bad = [0, 1, 31, 32, 63, 64, 100, 101, 127, 128, 150, 199]
    for c, j in enumerate(bad):
        byte, scale = _POISON[c % len(_POISON)]
        kv.view(torch.uint8)[j] = byte
        sc[j] = scale
    assert not torch.isfinite(kv.float() * sc.unsqueeze(1)).all(1)[bad].any()
    w = torch.randn(s_q, h, device=DEVICE)
    ks = torch.tensor([2, 33, 65, 102, 151, 2, 129], dtype=torch.int32, device=DEVICE)
    ke = torch.tensor([31, 63, 100, 127, 199, 2, 150], dtype=torch.int32, device=DEVICE)  # row 5 empty
    want = fp8_mqa_logits_reference(q, kv, sc, w, ks, ke)
    assert not torch.isnan(want).any()
    if cfg is None:
        got = flash_mla.fp8_mqa_logits(q, (kv, sc), w, ks, ke, clean_logits=clean_logits)
    else:
        got = torch.full((s_q, s_kv), 7.0, device=DEVICE)
        launch_mqa_logits(q.view(torch.uint8), kv.view(torch.uint8), sc, w, ks, ke, got, num_sms=1, config=cfg)
    assert not torch.isnan(got).any() and torch.equal(torch.isinf(got), torch.isinf(want))
    close_to(got, want, fp8_mqa_logits_reference(abs_e4m3(q), abs_e4m3(kv), sc.abs(), w.abs(), ks, ke), d=d)
    j = torch.arange(s_kv, device=DEVICE)
    inside = (j >= ks.long().unsqueeze(1)) & (j < ke.long().unsqueeze(1))
    assert torch.isfinite(got[inside]).all() and torch.isneginf(got[~inside]).all()


@needs_kernels
@pytest.mark.parametrize(
    "next_n, h, d, block_size, num_sms",
    [(1, 3, 32, 64, 1), (2, 64, 128, 64, 1), (3, 20, 64, 16, 2), (4, 5, 16, 7, 132), (4, 128, 32, 64, 1)],
)
def test_paged_logits_corner_cases(next_n, h, d, block_size, num_sms):
    # next_n 1..4, H not a multiple of 16 (and 128 with next_n 4: two groups of query positions),
    # contexts shorter than one page, shorter than next_n, ending inside a tile, exactly on a page;
    # num_sms 1 makes each program loop over several key tiles (and the fill of the -inf tail)
    b, nb = 5, 30
    cache, _ = fill_cache(nb, block_size, d, seed=next_n * 7 + h)
    q = random_q((b, next_n, h, d), seed=h + d)
    w = torch.randn(b * next_n, h, device=DEVICE)
    ctx_list = [block_size // 2 + 1, max(next_n - 2, 0), 2 * block_size, 3 * block_size + 5, 1]
    ctx = torch.tensor(ctx_list, dtype=torch.int32, device=DEVICE)
    table = torch.randperm(nb, generator=torch.Generator().manual_seed(d))[: b * 6].view(b, 6).int().to(DEVICE)
    max_len = 4 * block_size + 3
    meta = flash_mla.get_paged_mqa_logits_metadata(ctx.cpu(), block_size, num_sms)
    got = flash_mla.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, max_len)
    want = fp8_paged_mqa_logits_reference(q, cache, w, ctx, table, max_len)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and not torch.isnan(got).any()
    close_to(
        got,
        want,
        fp8_paged_mqa_logits_reference(abs_e4m3(q), abs_index_cache(cache), w.abs(), ctx, table, max_len),
        d=d,
    )
    for i, c in enumerate(ctx_list):  # query position p sees keys j <= c - next_n + p, exactly
        for p in range(next_n):
            seen = max(min(c - next_n + p + 1, c), 0)
            row = got[i * next_n + p]
            assert torch.isfinite(row[:seen]).all() and torch.isneginf(row[seen:]).all()


@needs_kernels
@pytest.mark.parametrize("h, d, s_q, s_kv", [(64, 128, 5, 300), (3, 32, 33, 129), (128, 16, 3, 64), (7, 64, 17, 1)])
def test_mqa_logits_corner_cases(h, d, s_q, s_kv):
    # partial key tiles, H not a multiple of 16, rows with no valid keys, ranges past s_kv,
    # key tiles outside every row's range (skipped, -inf), tiles split over programs
    q = random_q((s_q, h, d), seed=s_q + h)
    kv = random_q((s_kv, d), seed=s_kv)
    sc = torch.rand(s_kv, device=DEVICE) + 0.05
    w = torch.randn(s_q, h, device=DEVICE)
    g = torch.Generator().manual_seed(s_q)
    ks = torch.randint(-3, s_kv + 2, (s_q,), generator=g)
    ke = ks + torch.randint(-2, s_kv // 2 + 3, (s_q,), generator=g)
    ks[0], ke[0] = 0, s_kv  # a full row
    ks[-1], ke[-1] = s_kv, s_kv + 40  # an empty row past the keys
    ks, ke = ks.int().to(DEVICE), ke.int().to(DEVICE)
    got = flash_mla.fp8_mqa_logits(q, (kv, sc), w, ks, ke)
    want = fp8_mqa_logits_reference(q, kv, sc, w, ks, ke)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and not torch.isnan(got).any()
    close_to(got, want, fp8_mqa_logits_reference(abs_e4m3(q), abs_e4m3(kv), sc, w.abs(), ks, ke), d=d)
    assert torch.isneginf(got[-1]).all()


@needs_kernels
@pytest.mark.parametrize("fp8_dot", [True, False])
def test_logits_kernels_both_dot_paths(fp8_dot):
    # the e4m3 dot (sm_89+) and the integer e4m3 decode of older GPUs give the twin's logits, on
    # every e4m3 byte (subnormals, +-0, 448, NaN) and with several tiles per program
    from sparse_mla.indexer.kernels import fp8_dot_supported, launch_mqa_logits, launch_paged_mqa_logits

    if fp8_dot and ON_GPU and not fp8_dot_supported(torch.device(DEVICE)):
        pytest.skip("no e4m3 dot on this GPU")
    d, h, s_kv = 32, 4, 256  # e4m3 tensor-core dots need head_dim >= 32
    kv8 = torch.arange(s_kv, dtype=torch.int32).to(torch.uint8).view(s_kv, 1).repeat(1, d)
    kv8[:, 1:] = torch.randint(0, 256, (s_kv, d - 1), generator=torch.Generator().manual_seed(3)).to(torch.uint8)
    if fp8_dot and not ON_GPU:  # Triton 3.6's interpreter reads e4m3 NaN bytes (0x7F, 0xFF) as +-480
        kv8[(kv8 & 0x7F) == 0x7F] -= 1
    nan_bytes = not (fp8_dot and not ON_GPU)
    kv8 = kv8.to(DEVICE)
    kv = kv8.view(torch.float8_e4m3fn)
    q = random_q((6, h, d), seed=4)
    sc = torch.rand(s_kv, device=DEVICE) + 0.1
    w = torch.randn(6, h, device=DEVICE)
    ks = torch.tensor([0, 3, 70, 0, 200, 256], dtype=torch.int32, device=DEVICE)
    ke = torch.tensor([256, 140, 71, 0, 256, 256], dtype=torch.int32, device=DEVICE)
    out = torch.empty(6, s_kv, device=DEVICE)
    cfg = dict(fp8_dot=fp8_dot, block_n=32, rows=16)
    launch_mqa_logits(q.view(torch.uint8), kv8, sc, w, ks, ke, out, num_sms=1, config=cfg)
    want = fp8_mqa_logits_reference(q, kv, sc, w, ks, ke)
    assert torch.equal(torch.isnan(out), torch.isnan(want)) and bool(torch.isnan(want).any()) == nan_bytes
    fin = ~torch.isnan(want)
    close_to(
        out[fin].view(1, -1),
        want[fin].view(1, -1),
        fp8_mqa_logits_reference(abs_e4m3(q), abs_e4m3(kv), sc, w.abs(), ks, ke)[fin].view(1, -1),
        d=d,
    )
    # the paged kernel on a cache holding the same bytes (NaN keys give NaN logits, as the twin)
    bs, nb = 16, 16
    cache = torch.empty(nb, bs, 1, d + 4, dtype=torch.uint8, device=DEVICE)
    flat = cache.view(nb, -1)
    flat[:, : bs * d] = kv8.view(nb, bs * d)
    flat[:, bs * d :] = sc.view(nb, bs).contiguous().view(torch.uint8)
    qp = random_q((2, 2, h, d), seed=5)
    wp = torch.randn(4, h, device=DEVICE)
    ctx = torch.tensor([256, 77], dtype=torch.int32, device=DEVICE)
    table = torch.stack([torch.arange(nb), torch.arange(nb).flip(0)]).int().to(DEVICE)
    outp = torch.empty(4, 260, device=DEVICE)
    launch_paged_mqa_logits(qp.view(torch.uint8), cache, wp, ctx, table, outp, 260, num_sms=1, config=cfg)
    wantp = fp8_paged_mqa_logits_reference(qp, cache, wp, ctx, table, 260)
    assert torch.equal(torch.isnan(outp), torch.isnan(wantp)) and bool(torch.isnan(wantp).any()) == nan_bytes
    fin = ~torch.isnan(wantp)
    mag = fp8_paged_mqa_logits_reference(abs_e4m3(qp), abs_index_cache(cache), wp.abs(), ctx, table, 260)
    close_to(outp[fin].view(1, -1), wantp[fin].view(1, -1), mag[fin].view(1, -1), d=d)


@needs_kernels
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize(
    "next_n, h, d, block_size, block_n",
    [(2, 8, 32, 64, 64), (3, 5, 64, 128, 64), (1, 16, 256, 32, 32), (2, 64, 128, 64, 64)],
)
def test_paged_logits_tensor_memory_path(tma, next_n, h, d, block_size, block_n):
    # the Hopper path that brings each tile's keys and scales with tensor-memory copies (forced on
    # here, so the interpreter runs it too) against the twin and the pointer path: a pool view
    # (block stride past the block's bytes), block ids < 0 and >= num_blocks inside the context, a
    # table shorter than the context, contexts ending inside a tile, NaN bytes and scales in every
    # slot no query attends
    from sparse_mla.indexer.kernels import launch_paged_mqa_logits, tma_supported

    if tma and ON_GPU and not tma_supported(torch.device(DEVICE)):
        pytest.skip("no tensor-memory accelerator on this GPU")
    b, nb = 4, 12
    last = d + 4
    stride_blk = block_size * last + 16
    pool = torch.full((nb * stride_blk,), 0x7F, dtype=torch.uint8, device=DEVICE)  # NaN bytes, NaN scales
    cache = pool.as_strided((nb, block_size, 1, last), (stride_blk, last, last, 1))
    g = torch.Generator().manual_seed(block_size + next_n)
    keys = (torch.randn(nb * block_size, d, generator=g) * 4).to(DEVICE)
    used = torch.tensor([0, 2, 3, 5, 6, 7, 9, 10])
    for blk in used.tolist():  # the blocks the table names hold real keys (others stay NaN)
        sl = torch.arange(blk * block_size, (blk + 1) * block_size, device=DEVICE)
        flash_mla.indexer_k_quant_and_cache(keys[sl].to(torch.bfloat16), cache, sl, "ue8m0")
    if not ON_GPU:  # Triton 3.6's interpreter reads e4m3 NaN bytes as +-480 inside FP8 dots
        assert not bool(((cache.view(nb, -1)[used, : block_size * d] & 0x7F) == 0x7F).any())
    q = random_q((b, next_n, h, d), seed=h)
    w = torch.randn(b * next_n, h, device=DEVICE)
    ctx = torch.tensor([block_size + 5, 2 * block_size + block_n // 2, 3 * block_size, 7], dtype=torch.int32)
    table = torch.tensor([[0, 2, 3], [5, -1, 6], [7, nb + 3, 9], [10, 4, 4]], dtype=torch.int32)[:, :3]
    table = table.to(DEVICE)
    ctx = ctx.to(DEVICE)
    ctx[2] = 4 * block_size  # past the table's 3 pages: the last page's keys are -inf
    max_len = 4 * block_size + 9
    out = torch.empty(b * next_n, max_len, device=DEVICE)
    cfg = dict(fp8_dot=True, tma=tma, block_n=block_n)
    launch_paged_mqa_logits(q.view(torch.uint8), cache, w, ctx, table, out, max_len, num_sms=1, config=cfg)
    want = fp8_paged_mqa_logits_reference(q, cache, w, ctx, table, max_len)
    assert not torch.isnan(out).any() and torch.equal(torch.isinf(out), torch.isinf(want))
    fin = torch.isfinite(want)
    mag = fp8_paged_mqa_logits_reference(abs_e4m3(q), abs_index_cache(cache), w.abs(), ctx, table, max_len)
    close_to(out[fin].view(1, -1), want[fin].view(1, -1), mag[fin].view(1, -1), d=d)
    assert torch.isneginf(out[next_n : 2 * next_n, block_size : 2 * block_size]).all()  # block id -1
    assert torch.isneginf(out[2 * next_n : 3 * next_n, block_size : 2 * block_size]).all()  # block id >= nb


# ------------------------------------------------------------------------------ top-k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_topk_ranks_subnormal_logits_exactly(dtype):
    # tiny logits (subnormal in the row's dtype, +-0, one below the smallest normal) rank exactly as
    # the twin ranks them in fp32; Triton's interpreter converted bf16 subnormals to other values
    tiny = torch.finfo(dtype).tiny
    vals = [0.0, tiny / 64, tiny / 4, tiny / 2, tiny, -tiny / 64, -0.0, tiny * 0.75, -tiny]
    x = torch.tensor([vals, vals[::-1]], dtype=dtype).to(DEVICE)
    assert bool((x.float().abs() < tiny).logical_and(x != 0).any())  # the row holds subnormals
    for srt in (True, False):
        got = flash_mla.topk_indices(x, len(vals), sorted=srt)
        want = topk_indices_reference(x.float(), len(vals))
        assert torch.equal(got, want) if srt else same_index_sets(got, want)
    top1 = flash_mla.topk_indices(torch.tensor([[0.0, tiny / 64]], dtype=dtype).to(DEVICE), 1)
    assert top1.tolist() == [[1]]


@pytest.mark.parametrize("k", [1, 5, 64, 300])
def test_topk_matches_twin_and_tie_rule(k):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(6, 200, generator=g).round(decimals=1)  # many ties
    x[0, 10:20] = float("nan")
    x[1, :] = float("-inf")
    x[2, 50] = -0.0
    x[2, 40] = 0.0
    lo = torch.tensor([0, 0, 30, 150, 199, 0])
    hi = torch.tensor([200, 120, 60, 150, 400, 3])
    got = flash_mla.topk_indices(x.to(DEVICE), k, lo.to(DEVICE), hi.to(DEVICE))
    assert torch.equal(got.cpu(), topk_indices_reference(x, k, lo, hi).cpu())
    if k >= 5:
        assert (got[3] == -1).all() and got[4, 0] == 199 and (got[4, 1:] == -1).all()
        assert got[5, :3].tolist() == sorted(range(3), key=lambda j: (-float(x[5, j]), j))


def _tied_rows(n: int, k: int, dtype: torch.dtype = torch.float32):
    """7 rows with many exact ties at the k-th value, +-inf, NaN, +-0; ranges clipped, one empty,
    one the whole row."""
    g = torch.Generator().manual_seed(n + k)
    rows = 7
    x = (torch.randn(rows, n, generator=g) * 4).round() / 4  # few distinct values: ties everywhere
    x[0] = 1.5  # one row entirely tied
    x[1, ::3] = float("-inf")
    x[2, ::5] = float("nan")
    x[3, ::2] = -0.0
    x[4, : n // 2] = float("inf")
    x = x.to(dtype)
    lo = torch.randint(-5, max(n // 3, 1), (rows,), generator=g)
    hi = lo + torch.randint(0, n + 10, (rows,), generator=g)
    lo[5], hi[5] = n // 2, n // 2  # empty
    lo[6], hi[6] = 0, n  # whole row
    return x, lo, hi


# (the kernel's in-register sort of k keys is slow in the interpreter: the large-k rows run once)
@pytest.mark.parametrize(
    "n, k, dtype",
    [(n, k, dt) for n, k in [(1, 1), (257, 16), (2048, 100), (5000, 300)] for dt in (torch.float32, torch.bfloat16)]
    + [(700, 700, torch.float32), (900, 2048, torch.bfloat16)],
)
def test_topk_random_rows_with_ties_match_twin(n, k, dtype):
    # the radix passes, the compaction and the sort on tied rows; k > n; the default (whole) ranges;
    # n 2048: the register path with unmasked row loads (n a power of two), fp32 and bf16
    x, lo, hi = _tied_rows(n, k, dtype)
    got = flash_mla.topk_indices(x.to(DEVICE), k, lo.to(DEVICE), hi.to(DEVICE))
    want = topk_indices_reference(x.float(), k, lo, hi)
    assert torch.equal(got.cpu(), want.cpu())
    xs = x if k <= 300 else x[:2]
    assert torch.equal(flash_mla.topk_indices(xs.to(DEVICE), k).cpu(), topk_indices_reference(xs.float(), k).cpu())


@pytest.mark.skipif(not KERNELS, reason="runs the Triton kernel (a GPU or TRITON_INTERPRET=1)")
@pytest.mark.parametrize(
    "n, k, cfg",
    [
        (3000, 100, {"compact": 64, "block": 512, "bisect": 0}),
        (3000, 100, {"compact": 4096, "block": 256, "programs_per_sm": 64, "bisect": 0}),
        (5000, 300, {"compact": 2048, "block": 256, "programs_per_sm": 1, "bisect": 0}),
        (5000, 300, {"compact": 2048, "block": 512, "programs_per_sm": 16, "split_block": 256, "bisect": 0}),
        (3000, 100, {"compact": 64, "block": 256, "programs_per_sm": 16, "bisect": 0}),
        (5000, 300, {"bisect": 8192}),
        (3000, 100, {"bisect": 4096, "block": 256, "bisect_warps": 4}),
        (700, 700, {"bisect": 1024, "block": 512}),
    ],
)
def test_topk_kernel_configs_match_twin(n, k, cfg):
    # steps of BLOCK entries that straddle lo and hi, and the radix select's candidate list (compact: the k-th key's 16-bit bucket gathered when it fits in
    # the capacity, the row passes when not: the tied rows hold buckets of every size), its rows
    # split in 1 to 16 segments (programs_per_sm; the interpreter counts one SM); bisect 0 keeps
    # them off the register path that rows of up to `bisect` entries take (its own rows last)
    from sparse_mla.indexer.kernels import launch_topk

    x, lo, hi = _tied_rows(n, k)
    x[5:] = torch.randn(2, n) * 3  # rows of distinct values: small buckets
    x, lo, hi = x.to(DEVICE), lo.to(DEVICE).clamp(0, n), hi.to(DEVICE).clamp(0, n)
    hi = torch.maximum(hi, lo)
    hi[5] = n
    out = torch.empty(x.shape[0], k, dtype=torch.int32, device=DEVICE)
    launch_topk(x, lo, hi, out, k, k, config=cfg)
    assert torch.equal(out.cpu(), topk_indices_reference(x.cpu(), k, lo.cpu(), hi.cpu()))


@pytest.mark.skipif(not KERNELS, reason="runs the Triton kernel (a GPU or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("ordered, n", [(True, 3000), (False, 3000), (True, 4096), (False, 4096)])
def test_topk_register_path_every_phase(ordered, n):
    # the register path's phases (k 100: a candidate list of cap = 2 x 128 = 256): the top bits
    # until <= 256 keys are at or above them, the list, the rest of the bits on it, the select; a
    # range already within the cap (no top bits); 180 keys tied at the k-th (with the 60 above them
    # the list holds them: the tie rule on the list) and 300 (more than the cap: the select pass over
    # the row); all
    # negative; NaN, +-inf and -0.0 around the k-th; exactly k keys at or above a prefix; the top
    # bits two keys a register, on rows whose k-th key lies among NaN / -inf, whose keys share their top 17
    # bits (the packed bits find nothing), and of subnormals of both signs; a negative k-th key with 31
    # positive keys above it (the lanes of keys whose top bit ranks above), 200 positive keys among
    # negative ones (the top bit alone decides: a list after one bit), exactly the cap (256) at or
    # above the k-th key. n 4096 (a power of two: the row loads take no mask) repeats each row's first
    # 1096 entries after its 3000
    from sparse_mla.indexer.kernels import launch_topk

    g = torch.Generator().manual_seed(11)
    k = 100
    x = torch.randn(14, 3000, generator=g)
    lo = torch.zeros(14, dtype=torch.int64)
    hi = torch.full((14,), n, dtype=torch.int64)
    lo[1], hi[1] = 1000, 1200  # 200 entries: within the cap
    x[2, :60] = 9.0
    x[2, 500:680] = 5.0  # 60 above, 180 tied at the k-th: 40 of them by position
    x[3, :60] = 9.0
    x[3, 500:800] = 5.0  # 300 tied: more than the cap
    x[4] = -x[4].abs() - 1.0  # all negative
    x[5, ::7] = float("nan")
    x[5, 1::11] = float("inf")
    x[5, 2::13] = float("-inf")
    x[5, 3::17] = -0.0
    x[6] = torch.arange(3000, dtype=torch.float32) / 4096  # exactly k keys >= a bit prefix often
    x[7] = torch.randn(3000, generator=g) * 1e-30  # tiny values: the bits run long
    x[8] = float("nan")
    x[8, :50] = torch.randn(50, generator=g)
    x[8, 50:80] = float("-inf")  # 50 finite, 30 -inf, then NaN by position
    x[9] = 1.0 + torch.arange(3000, dtype=torch.float32) * 2.0**-23  # one top 17 bits for all
    x[10] = torch.randn(3000, generator=g).sign() * 1e-40 * torch.rand(3000, generator=g)  # subnormals
    x[11] = -torch.rand(3000, generator=g) - 1.0
    x[11, ::97] = torch.rand(31, generator=g) + 0.5  # 31 positive: the k-th key is negative
    x[12] = -torch.rand(3000, generator=g) - 1.0
    x[12, ::15] = torch.rand(200, generator=g)  # 200 positive: 100 <= 200 <= 256 after the top bit
    x[13] = torch.randn(3000, generator=g).clamp(max=4.0)
    x[13, 100:356] = 5.0  # 256 tied above the rest: exactly the cap
    x = torch.cat([x, x[:, : n - 3000]], 1)
    out = torch.empty(14, k, dtype=torch.int32, device=DEVICE)
    args = (x.to(DEVICE), lo.to(DEVICE), hi.to(DEVICE), out, k, k)
    cfg = {"bisect": 4096, "bisect_cap": 2}
    launch_topk(*args, config=cfg, ordered=ordered)
    want = topk_indices_reference(x, k, lo, hi)
    assert torch.equal(out.cpu(), want) if ordered else same_index_sets(out, want)


@needs_kernels
@pytest.mark.parametrize("path", [{}, {"bisect": 0}])
def test_topk_without_ranges_matches_full_ranges(path):
    # no row_starts / row_ends: the kernels take [0, n) without range tensors (nothing to fill)
    from sparse_mla.indexer.kernels import launch_topk

    g = torch.Generator().manual_seed(7)
    rows, n, k = 3, 700, 40
    x = torch.randn(rows, n, generator=g).to(DEVICE)
    x[1, 5:300] = 0.25  # ties at the k-th value
    got = torch.empty(rows, k, dtype=torch.int32, device=DEVICE)
    want = torch.empty_like(got)
    launch_topk(x, None, None, got, k, k, config=path)
    ends = torch.zeros(rows, dtype=torch.int64, device=DEVICE), torch.full((rows,), n, device=DEVICE)
    launch_topk(x, *ends, want, k, k, config=path)
    assert torch.equal(got.cpu(), want.cpu())
    assert torch.equal(got.cpu(), topk_indices_reference(x.cpu(), k))


def test_topk_kvcache_block_table_on_another_device_names_logits():
    # (the message once named "the indices", an argument this call does not have)
    import sparse_mla

    table = torch.zeros(2, 5, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=r"block_table: must be on the same device as logits \(cpu\)"):
        sparse_mla.topk_kvcache_indices(torch.randn(2, 300), 5, table, 64)


@pytest.mark.parametrize(
    "cfg, key",
    [({"bisect_cap": 3}, "bisect_cap"), ({"bisect_cap": 0}, "bisect_cap"), ({"bisect_cap": 2.0}, "bisect_cap"),
     ({"bisect_warps": 3}, "bisect_warps"), ({"bisect_warps": 64}, "bisect_warps"), ({"bisect_warps": True}, "bisect_warps")],
)  # fmt: skip
def test_topk_register_path_config_is_checked(cfg, key):
    # (a list capacity of 3 x k or 3 warps left a list or a row that
    # does not fill every thread: an assertion inside the kernel, or an arange of 192 entries)
    from sparse_mla.indexer.kernels import launch_topk

    x = torch.randn(1, 200, device=DEVICE)
    ends = torch.tensor([0], device=DEVICE), torch.tensor([200], device=DEVICE)
    with pytest.raises(ValueError, match=f"config: {key} must be (a power of two|a bool|an int|0 \\(the compiler)"):
        launch_topk(x, *ends, torch.empty(1, 64, dtype=torch.int32, device=DEVICE), 64, 64, config=cfg)


@pytest.mark.parametrize(
    "cfg, key",
    [({"block": 100}, "block"), ({"block": 2048.0}, "block"), ({"block": 32768}, "block"), ({"split_block": 0}, "split_block"),
     ({"split_block": 32768}, "split_block"),
     ({"num_warps": 3}, "num_warps"), ({"final_warps": 3}, "final_warps"), ({"programs_per_sm": 0}, "programs_per_sm"),
     ({"bisect": -1}, "bisect"), ({"bisect": "32768"}, "bisect"), ({"compact": None}, "compact"),
     ({"compact": 0}, "compact"), ({"bisect_pak16": True}, "unknown key")],
)  # fmt: skip
def test_topk_launch_config_is_checked(cfg, key):
    # (unchecked keys crashed on tie-heavy rows or the radix path only; steps of 32768 entries
    # overflow the select's two counts packed in one int32)
    from sparse_mla.indexer.kernels import launch_topk

    x = torch.randn(2, 300, device=DEVICE)
    out = torch.empty(2, 5, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=f"config: {key}"):
        launch_topk(x, None, None, out, 5, 5, config=cfg)
    with pytest.raises(TypeError, match="config: expected a dict"):
        launch_topk(x, None, None, out, 5, 5, config=[("block", 256)])


def test_topk_launch_sizes_are_checked():
    # kk not min(k, n), kk 0, an out too small or of another dtype, ranges of another length: each
    # wrote past a buffer (heap corruption, a segfault) before the launcher checked them
    from sparse_mla.indexer.kernels import launch_topk

    x = torch.randn(2, 300, device=DEVICE)
    out = torch.empty(2, 5, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="kk: expected min"):
        launch_topk(x, None, None, out, 5, 1)
    with pytest.raises(ValueError, match="kk: expected an int >= 1"):
        launch_topk(x, None, None, out, 5, 0)
    with pytest.raises(ValueError, match="out: expected"):
        launch_topk(x, None, None, out[:, :3], 5, 5)
    with pytest.raises(TypeError, match="out"):
        launch_topk(x, None, None, out.long(), 5, 5)
    with pytest.raises(ValueError, match="hi: expected"):
        launch_topk(x, None, torch.full((3,), 300, device=DEVICE), out, 5, 5)
    with pytest.raises(ValueError, match="logits: entries must be contiguous"):
        launch_topk(torch.randn(300, 2, device=DEVICE).t(), None, None, out, 5, 5)
    # an out that shares bytes with what the kernels read (they would read their own writes), or
    # holds an element twice
    with pytest.raises(ValueError, match="out: must not overlap an input"):
        launch_topk(x, None, None, x.view(torch.int32)[:, :5], 5, 5)
    buf = torch.zeros(11, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="out: must not overlap an input"):
        launch_topk(x, buf[:2], None, buf[1:].view(2, 5), 5, 5)
    with pytest.raises(ValueError, match="out: its elements overlap"):
        launch_topk(x, None, None, out[:1].expand(2, 5), 5, 5)


@pytest.mark.skipif(not KERNELS, reason="runs the Triton kernel (a GPU or TRITON_INTERPRET=1)")
@settings(max_examples=20, deadline=None)
@given(
    st.integers(1, 3000),  # n
    st.integers(1, 300),  # k
    st.sampled_from([1, 2, 4]),  # bisect_cap (a power of two)
    st.integers(1, 40),  # distinct levels (few: ties at the k-th value of every size)
    st.booleans(),  # specials (NaN, +-inf, -0.0)
    st.integers(0, 2**31 - 1),  # seed
)
def test_topk_register_path_random_rows_match_twin(n, k, cap, levels, specials, seed):
    # the register path on random rows, ranges and list capacities: in rank order equal to the
    # twin, without the order the same set and the same order on a second call
    from sparse_mla.indexer.kernels import launch_topk

    g = torch.Generator().manual_seed(seed)
    rows = 3
    x = torch.randint(0, levels, (rows, n), generator=g).float() - levels / 2
    x[1] = torch.randn(n, generator=g)  # a row of distinct values
    if specials:
        for v in (float("nan"), float("inf"), float("-inf"), -0.0):
            x[torch.rand(rows, n, generator=g) < 0.05] = v
    lo = torch.randint(-3, n // 2 + 1, (rows,), generator=g)
    hi = lo + torch.randint(0, n + 4, (rows,), generator=g)
    lo[0], hi[0] = 0, n
    lo_d, hi_d = lo.clamp(0, n).to(DEVICE), torch.maximum(hi.clamp(0, n), lo.clamp(0, n)).to(DEVICE)
    want = topk_indices_reference(x, k, lo_d.cpu(), hi_d.cpu())
    cfg = {"bisect": 4096, "bisect_cap": cap, "bisect_warps": 4}
    out = torch.empty(rows, k, dtype=torch.int32, device=DEVICE)
    launch_topk(x.to(DEVICE), lo_d, hi_d, out, k, min(k, n), config=cfg)
    kk_p2 = 1 << (min(k, n) - 1).bit_length()  # the launcher writes columns < next_power_of_2(kk)
    assert torch.equal(out.cpu()[:, :kk_p2], want[:, :kk_p2])
    unsorted = [torch.empty(rows, k, dtype=torch.int32, device=DEVICE) for _ in range(2)]
    for u in unsorted:
        launch_topk(x.to(DEVICE), lo_d, hi_d, u, k, min(k, n), config=cfg, ordered=False)
    assert same_index_sets(unsorted[0][:, :kk_p2], want[:, :kk_p2])
    assert torch.equal(unsorted[0][:, :kk_p2], unsorted[1][:, :kk_p2])


@pytest.mark.parametrize(
    "n, k, cfg",
    [
        (3000, 100, {"compact": 64, "block": 512, "bisect": 0}),
        (5000, 300, {"compact": 2048, "block": 256, "programs_per_sm": 1, "bisect": 0}),
        (5000, 300, {"bisect": 8192, "block": 1024}),
    ],
)
def test_topk_unsorted_is_the_same_set(n, k, cfg):
    # sorted=False leaves the kernels' final sort out: the same entries (the tie rule included) in
    # the order the select wrote them, on both candidate-list paths of the radix select and the register path
    from sparse_mla.indexer.kernels import launch_topk

    x, lo, hi = _tied_rows(n, k)
    x[5:] = torch.randn(2, n) * 3
    x, lo, hi = x.to(DEVICE), lo.to(DEVICE).clamp(0, n), hi.to(DEVICE).clamp(0, n)
    hi = torch.maximum(hi, lo)
    hi[5] = n
    out = torch.empty(x.shape[0], k, dtype=torch.int32, device=DEVICE)
    launch_topk(x, lo, hi, out, k, k, config=cfg, ordered=False)
    want = topk_indices_reference(x.cpu(), k, lo.cpu(), hi.cpu())
    assert same_index_sets(out, want)
    assert not torch.equal(out.cpu(), want)  # the order is not the rank order (the sort really is left out)


def test_topk_sorted_argument():
    g = torch.Generator().manual_seed(5)
    b, next_n, n, k, pbs = 2, 2, 300, 40, 16
    logits = torch.randn(b * next_n, n, generator=g).to(DEVICE)
    ends = torch.tensor([300, 20, 150, 299], device=DEVICE)
    want = flash_mla.topk_indices(logits, k, row_ends=ends)
    assert same_index_sets(flash_mla.topk_indices(logits, k, row_ends=ends, sorted=False), want)
    table = torch.randperm(64, generator=g).view(b, 32).int().to(DEVICE)
    want_slots = flash_mla.topk_kvcache_indices(logits, k, table, pbs, next_n, row_ends=ends)
    got_slots = flash_mla.topk_kvcache_indices(logits, k, table, pbs, next_n, row_ends=ends, sorted=False)
    assert got_slots.shape == want_slots.shape and same_index_sets(got_slots, want_slots)
    for bad in (1, None, "no"):
        with pytest.raises(TypeError, match="sorted: expected a bool"):
            flash_mla.topk_indices(logits, k, sorted=bad)
        with pytest.raises(TypeError, match="sorted: expected a bool"):
            flash_mla.topk_kvcache_indices(logits, k, table, pbs, next_n, sorted=bad)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_topk_k_past_the_row_is_bounded(backend):
    """``k`` beyond the row pads with -1 up to MAX_PADDED_K; a ``k`` no row can mean (2^31 - 1 on a
    10-wide row asked for an 8.6 GB output) is a ValueError before anything is allocated."""
    from sparse_mla.indexer.topk import MAX_PADDED_K

    logits = torch.randn(2, 10, device=DEVICE)
    table = torch.arange(4, dtype=torch.int32, device=DEVICE).view(2, 2)
    out = flash_mla.topk_indices(logits, 2048, backend=backend)
    assert out.shape == (2, 2048) and (out[:, 10:] == -1).all()
    assert torch.equal(out[:, :10].sort(dim=1).values.cpu(), torch.arange(10, dtype=torch.int32).expand(2, 10))
    peak = torch.cuda.max_memory_allocated() if ON_GPU else None
    for k in (MAX_PADDED_K + 1, 2**31 - 1):
        with pytest.raises(ValueError, match=f"^k: {k} is more than the row's 10 positions"):
            flash_mla.topk_indices(logits, k, backend=backend)
        with pytest.raises(ValueError, match="^k: "):
            flash_mla.topk_kvcache_indices(logits, k, table, 8, backend=backend)
    if ON_GPU:
        assert torch.cuda.max_memory_allocated() == peak
    if backend == "reference" or ON_GPU:  # k up to the row's width is always fine (a long row: slow interpreted)
        wide = torch.randn(1, MAX_PADDED_K + 5, device=DEVICE)
        assert flash_mla.topk_indices(wide, MAX_PADDED_K + 1, backend=backend).shape == (1, MAX_PADDED_K + 1)


@pytest.mark.parametrize("pbs, next_n, k", [(1, 1, 7), (3, 2, 16), (64, 3, 40)])
def test_topk_kvcache_indices_match_twin_at_the_table_edges(pbs, next_n, k):
    # the fused slot map against topk + abs_indices_to_kvcache_indices: positions past the block
    # table, negative (unmapped) blocks, a slot past int32, rows with fewer than k candidates
    g = torch.Generator().manual_seed(pbs * 100 + k)
    b, n = 3, 200
    logits = torch.randn(b * next_n, n, generator=g)
    logits[0, 5] = float("nan")
    nlog = max(n // pbs - 2, 1)  # the last positions of a row have no table entry
    table = torch.randint(0, 50, (b, nlog), generator=g, dtype=torch.int32)
    table[0, ::3] = -1
    table[1, 0] = (2**31 - 1) // pbs  # its last slots are past int32 (pbs > 1)
    ends = torch.randint(0, n + 1, (b * next_n,), generator=g)
    ends[0] = 3  # fewer candidates than k
    logits[next_n, :pbs] = 10.0  # request 1's first query picks the positions of table[1, 0]
    ends[next_n] = n
    got = flash_mla.topk_kvcache_indices(logits.to(DEVICE), k, table.to(DEVICE), pbs, next_n, row_ends=ends.to(DEVICE))
    pos = topk_indices_reference(logits, k, None, ends).view(b, next_n, k)
    want = abs_indices_to_kvcache_indices(pos, table, pbs)
    assert got.shape == (b, next_n, k) and got.dtype == torch.int32
    assert torch.equal(got.cpu(), want)
    assert (want == -1).any() and (want >= 0).any()
    # unsorted: the slots of the unsorted positions, in their order (the list path writes them
    # straight into the output row)
    got_u = flash_mla.topk_kvcache_indices(
        logits.to(DEVICE), k, table.to(DEVICE), pbs, next_n, row_ends=ends.to(DEVICE), sorted=False
    )
    pos_u = flash_mla.topk_indices(logits.to(DEVICE), k, row_ends=ends.to(DEVICE), sorted=False).cpu()
    assert torch.equal(got_u.cpu(), abs_indices_to_kvcache_indices(pos_u.view(b, next_n, k), table, pbs))
    assert torch.equal(got_u.cpu().sort(-1).values, want.sort(-1).values)
    # int64 entries whose product with the page size overflows int64 (2^62 * 64 wraps to 0): no slot
    big = table.long()
    big[2, :] = 2**62
    got_big = flash_mla.topk_kvcache_indices(
        logits.to(DEVICE), k, big.to(DEVICE), np.int64(pbs), next_n, row_ends=ends.to(DEVICE)
    )
    assert torch.equal(got_big.cpu(), abs_indices_to_kvcache_indices(pos, big, pbs))
    assert (got_big[2] == -1).all()
    # the table as a strided view (every other column of a wider one)
    wide = torch.zeros(b, 2 * nlog, dtype=torch.int32)
    wide[:, ::2] = table
    got_view = flash_mla.topk_kvcache_indices(
        logits.to(DEVICE), k, wide.to(DEVICE)[:, ::2], pbs, next_n, row_ends=ends.to(DEVICE)
    )
    assert torch.equal(got_view.cpu(), want)


def test_topk_kvcache_indices_are_decode_indices():
    b, next_n, pbs = 2, 2, 4
    logits = torch.randn(b * next_n, 12, device=DEVICE)
    table = torch.tensor([[7, 2, 9], [4, 0, 5]], dtype=torch.int32, device=DEVICE)
    ends = torch.tensor([10, 11, 3, 4], device=DEVICE)
    got = flash_mla.topk_kvcache_indices(logits, 6, table, pbs, next_n, row_ends=ends)
    pos = flash_mla.topk_indices(logits, 6, row_ends=ends).view(b, next_n, 6)
    assert got.shape == (b, next_n, 6) and got.dtype == torch.int32
    for i in range(b):
        for p in range(next_n):
            for c in range(6):
                j = int(pos[i, p, c])
                assert int(got[i, p, c]) == (-1 if j < 0 else int(table[i, j // pbs]) * pbs + j % pbs)


# ------------------------------------------------------------------------------ one decode step


@needs_kernels
def test_one_decode_step_end_to_end():
    # indexer cache write -> paged logits -> top-k -> slot ids -> sparse decode, against the twins
    b, next_n, h_idx, d_idx, pbs, topk, h_q = 2, 2, 8, 64, 16, 32, 16
    ctx_len = [70, 45]
    nb = 16
    table = torch.randperm(nb)[: 2 * 5].view(2, 5).int().to(DEVICE)
    g = torch.Generator().manual_seed(11)
    # the indexer keys and the attention latents of every context token, written through the block table
    slots = torch.cat(
        [
            table[i].repeat_interleave(pbs)[: ctx_len[i]].long() * pbs + torch.arange(ctx_len[i], device=DEVICE) % pbs
            for i in range(b)
        ]
    )
    idx_cache = empty_cache(nb, pbs, d_idx)
    flash_mla.indexer_k_quant_and_cache(random_keys(len(slots), d_idx, 12), idx_cache, slots)
    # latents of a quarter of unit scale, as the decode tests' caches: with unit-variance latents the
    # kernels' bf16 P (FlashMLA's too) put 1-2 of 32768 outputs past FlashMLA's absolute tolerance
    lat = torch.randn(nb, pbs, 1, 576, generator=g) * 0.25
    k_cache = flash_mla.quantize_k_cache(lat.to(torch.bfloat16).to(DEVICE), "V32")
    q_idx = random_q((b, next_n, h_idx, d_idx), seed=13)
    w = torch.rand(b * next_n, h_idx, device=DEVICE)
    ctx = torch.tensor(ctx_len, dtype=torch.int32, device=DEVICE)
    logits = flash_mla.fp8_paged_mqa_logits(
        q_idx, idx_cache, w, ctx, table, flash_mla.get_paged_mqa_logits_metadata(ctx, pbs, 132), 80
    )
    ends = ctx.repeat_interleave(next_n) - next_n + torch.arange(next_n, device=DEVICE).repeat(b) + 1
    indices = flash_mla.topk_kvcache_indices(logits, topk, table, pbs, next_n, row_ends=ends)
    # the same chain through the twins
    ref_logits = fp8_paged_mqa_logits_reference(q_idx, idx_cache, w, ctx, table, 80)
    close_to(
        logits,
        ref_logits,
        fp8_paged_mqa_logits_reference(abs_e4m3(q_idx), abs_index_cache(idx_cache), w.abs(), ctx, table, 80),
        d=d_idx,
    )
    # top-k of the kernel's logits (FP8 tensor cores round differently from the fp32 twin, so near
    # ties the twin's logits may pick other keys): the kernel's choice is the twin's on the same rows
    ref_pos = topk_indices_reference(logits.cpu(), topk, None, ends.cpu()).view(b, next_n, topk)
    assert torch.equal(flash_mla.topk_indices(logits, topk, row_ends=ends).cpu().view(b, next_n, topk), ref_pos)
    # queries of half the latents' scale: with unit-variance latents and only <= 32 keys per row a
    # unit-variance q gives a near one-hot softmax, where the kernels' bf16 P alone exceeded
    # FlashMLA's tolerance by 5e-5 on 2 of 32768 entries (H200); the chain, not that, is tested here
    q = (torch.randn(b, next_n, h_q, 576, generator=g) * 0.5).to(torch.bfloat16).to(DEVICE)
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(q, k_cache, None, None, 512, meta, is_fp8_kvcache=True, indices=indices)
    ro, rl = sparse_decode_reference(q, k_cache, indices, None, 512)
    check_decode_close(out, lse, ro, rl)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA device")
def test_cuda_graph_of_logits_and_topk_with_inputs_changed_in_place():
    # one CUDA graph holding the prefill logits, a sorted top-k of them (rows of 10000: the split
    # path) and the paged logits with next_n 2 (plus a sorted top-k of those through the decode's
    # row ends, computed in the graph); every input then rewritten in place (queries, keys, scales,
    # weights, ranges, context lengths, block table, cache bytes) and the graph replayed: the
    # eager calls' results, bit for bit, and the twins'
    s_q, s_kv, h, d, k = 48, 10000, 64, 128, 2048
    b, next_n, bs, nb, max_len = 6, 2, 64, 200, 4000
    q = torch.empty(s_q, h, d, dtype=torch.float8_e4m3fn, device=DEVICE)
    kv = torch.empty(s_kv, d, dtype=torch.float8_e4m3fn, device=DEVICE)
    sc = torch.empty(s_kv, device=DEVICE)
    w = torch.empty(s_q, h, device=DEVICE)
    ks = torch.empty(s_q, dtype=torch.int32, device=DEVICE)
    ke = torch.empty(s_q, dtype=torch.int32, device=DEVICE)
    qp = torch.empty(b, next_n, h, d, dtype=torch.float8_e4m3fn, device=DEVICE)
    wp = torch.empty(b * next_n, h, device=DEVICE)
    ctx = torch.empty(b, dtype=torch.int32, device=DEVICE)
    table = torch.empty(b, max_len // bs + 2, dtype=torch.int32, device=DEVICE)
    cache = empty_cache(nb, bs, d)
    meta = flash_mla.get_paged_mqa_logits_metadata(
        ctx.cpu(), bs, torch.cuda.get_device_properties(0).multi_processor_count
    )

    def refill(seed):
        g = torch.Generator().manual_seed(seed)
        q.copy_(random_q((s_q, h, d), seed))
        kv.copy_(random_q((s_kv, d), seed + 1))
        sc.copy_(torch.rand(s_kv, generator=g) + 0.05)
        w.copy_(torch.randn(s_q, h, generator=g))
        lo = torch.randint(0, s_kv // 2, (s_q,), generator=g)
        hi = lo + torch.randint(0, s_kv, (s_q,), generator=g)
        lo[0], hi[0] = 0, s_kv  # a whole row; a row of fewer than k keys; an empty row
        lo[1], hi[1] = 100, 100 + k // 3
        lo[2], hi[2] = 50, 50
        ks.copy_(lo.int())
        ke.copy_(hi.clamp(max=s_kv).int())
        qp.copy_(random_q((b, next_n, h, d), seed + 2))
        wp.copy_(torch.randn(b * next_n, h, generator=g))
        c = torch.randint(1, max_len + 1, (b,), generator=g)
        c[0], c[1] = 1, bs * 5 + 1  # a one-key context; one a key into its last page
        ctx.copy_(c.int())
        table.copy_(torch.randint(0, nb, table.shape, generator=g).int())
        flash_mla.indexer_k_quant_and_cache(
            random_keys(nb * bs, d, seed + 3), cache, torch.randperm(nb * bs, generator=g).to(DEVICE)
        )

    def step():
        lg = flash_mla.fp8_mqa_logits(q, (kv, sc), w, ks, ke)
        top = flash_mla.topk_indices(lg, k, ks, ke)
        plg = flash_mla.fp8_paged_mqa_logits(qp, cache, wp, ctx, table, meta, max_len)
        ends = ctx.repeat_interleave(next_n) - next_n + torch.arange(1, next_n + 1, device=DEVICE).repeat(b)
        ptop = flash_mla.topk_indices(plg, k, row_ends=ends)
        return lg, top, plg, ptop, ends

    refill(1)
    step()  # compiles the kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for trial in range(3):
        refill(10 + trial)
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for got, want in zip(outs, eager, strict=True):
            assert torch.equal(got, want)
        lg, top, plg, ptop, ends = outs
        want_lg = fp8_mqa_logits_reference(q, kv, sc, w, ks, ke)
        close_to(lg, want_lg, fp8_mqa_logits_reference(abs_e4m3(q), abs_e4m3(kv), sc, w.abs(), ks, ke))
        assert torch.equal(top.cpu(), topk_indices_reference(lg.cpu(), k, ks.cpu(), ke.cpu()))
        assert (top[1, k // 3 :] == -1).all() and (top[2] == -1).all()
        want_plg = fp8_paged_mqa_logits_reference(qp, cache, wp, ctx, table, max_len)
        mag = fp8_paged_mqa_logits_reference(abs_e4m3(qp), abs_index_cache(cache), wp.abs(), ctx, table, max_len)
        assert torch.equal(torch.isinf(plg), torch.isinf(want_plg))
        close_to(plg, want_plg, mag)
        assert torch.equal(ptop.cpu(), topk_indices_reference(plg.cpu(), k, None, ends.cpu()))
        # the one-key context: query 0 sees no key, query 1 key 0
        assert torch.isneginf(plg[0]).all() and torch.isfinite(plg[1, 0]) and torch.isneginf(plg[1, 1:]).all()
        assert (ptop[0] == -1).all() and ptop[1, 0] == 0 and (ptop[1, 1:] == -1).all()


# ------------------------------------------------------------------------------ validation


def _bad_calls():
    cache = torch.zeros(4, 16, 1, 132, dtype=torch.uint8)
    k = torch.zeros(3, 128, dtype=torch.bfloat16)
    slots = torch.zeros(3, dtype=torch.int64)
    store = flash_mla.indexer_k_quant_and_cache
    yield "kv_cache: expected dtype", TypeError, store, (k, cache.float(), slots)
    yield "kv_cache: last dim must be", ValueError, store, (k, torch.zeros(4, 16, 1, 100, dtype=torch.uint8), slots)
    yield "kv_cache: expected shape", ValueError, store, (k, torch.zeros(4, 8, 2, 132, dtype=torch.uint8), slots)
    yield "k: expected shape", ValueError, store, (k[:, :64], cache, slots)
    yield "k: expected dtype", TypeError, store, (k.to(torch.int32), cache, slots)
    yield "slot_mapping: expected shape", ValueError, store, (k, cache, slots[:2])
    yield "slot_mapping: expected dtype", TypeError, store, (k, cache, slots.float())
    yield "scale_fmt: expected", ValueError, store, (k, cache, slots, "e8m0")
    q = torch.zeros(2, 4, 128).to(torch.float8_e4m3fn)
    kv = (torch.zeros(10, 128).to(torch.float8_e4m3fn), torch.ones(10))
    w = torch.ones(2, 4)
    r = torch.zeros(2, dtype=torch.int32)
    mqa = flash_mla.fp8_mqa_logits
    yield "q: expected dtype", TypeError, mqa, (q.float(), kv, w, r, r)
    yield "q: head_dim must be", ValueError, mqa, (q[..., :100], kv, w, r, r)
    yield "kv: expected a tuple", TypeError, mqa, (q, kv[0], w, r, r)
    yield r"kv\[0\]: expected shape", ValueError, mqa, (q, (kv[0][:, :64], kv[1]), w, r, r)
    yield r"kv\[1\]: expected shape", ValueError, mqa, (q, (kv[0], kv[1][:9]), w, r, r)
    yield "weights: expected shape", ValueError, mqa, (q, kv, w[:, :3], r, r)
    yield "cu_seqlen_ke: expected dtype", TypeError, mqa, (q, kv, w, r, r.long())
    qp = torch.zeros(2, 2, 4, 128).to(torch.float8_e4m3fn)
    ctx = torch.ones(2, dtype=torch.int32)
    bt = torch.zeros(2, 3, dtype=torch.int32)
    meta = flash_mla.get_paged_mqa_logits_metadata(ctx, 16, 132)
    paged = flash_mla.fp8_paged_mqa_logits
    yield (
        "kv_cache: last dim must be 128 \\+ 4 \\(q.s head_dim\\)",
        ValueError,
        paged,
        (qp, torch.zeros(4, 16, 1, 68, dtype=torch.uint8), torch.ones(4, 4), ctx, bt, meta, 32),
    )
    yield "weights: expected shape", ValueError, paged, (qp, cache, torch.ones(2, 4), ctx, bt, meta, 32)
    yield "context_lens: expected shape", ValueError, paged, (qp, cache, torch.ones(4, 4), ctx[:1], bt, meta, 32)
    yield "block_table: expected shape", ValueError, paged, (qp, cache, torch.ones(4, 4), ctx, bt[:1], meta, 32)
    yield (
        "schedule_meta: made for block_size 8",
        ValueError,
        paged,
        (qp, cache, torch.ones(4, 4), ctx, bt, flash_mla.get_paged_mqa_logits_metadata(ctx, 8, 1), 32),
    )
    yield "max_context_len: expected an int", ValueError, paged, (qp, cache, torch.ones(4, 4), ctx, bt, meta, -1)
    yield "k: expected an int in", ValueError, flash_mla.topk_indices, (torch.zeros(2, 5), 0)
    yield "k: expected an int, got bool", TypeError, flash_mla.topk_indices, (torch.zeros(2, 5), True)
    yield "k: expected an int, got float", TypeError, flash_mla.topk_indices, (torch.zeros(2, 5), 10.0)
    yield (
        "logits: expected a CPU or CUDA tensor",
        ValueError,
        flash_mla.topk_indices,
        (torch.empty(2, 5, device="meta"), 3),
    )
    yield "k: expected an int in", ValueError, flash_mla.topk_indices, (torch.zeros(2, 5), 2**62)
    yield "max_context_len: expected an int", ValueError, paged, (qp, cache, torch.ones(4, 4), ctx, bt, meta, 10**30)
    yield (
        "page_block_size: expected an int",
        ValueError,
        flash_mla.topk_kvcache_indices,
        (torch.zeros(2, 5), 2, torch.zeros(2, 1, dtype=torch.int32), 10**30, 1),
    )
    yield "logits: expected dtype", TypeError, flash_mla.topk_indices, (torch.zeros(2, 5, dtype=torch.int32), 2)
    yield (
        "row_ends: expected shape",
        ValueError,
        flash_mla.topk_indices,
        (torch.zeros(2, 5), 2, None, torch.zeros(3, dtype=torch.int32)),
    )
    yield "block_size: expected a positive int", ValueError, flash_mla.get_paged_mqa_logits_metadata, (ctx, 0, 132)
    # meta tensors (no data) are refused by name, not left to fail inside a kernel
    m = "meta"
    yield "kv_cache: expected a CPU or CUDA tensor", ValueError, store, (k.to(m), cache.to(m), slots.to(m))
    yield "q: expected a CPU or CUDA tensor", ValueError, mqa, (q.to(m), (kv[0].to(m), kv[1].to(m)), w.to(m), r, r)
    yield "q: expected a CPU or CUDA tensor", ValueError, paged, (qp.to(m), cache, torch.ones(4, 4), ctx, bt, meta, 32)
    yield (
        "context_lens: expected a CPU or CUDA tensor",
        ValueError,
        flash_mla.get_paged_mqa_logits_metadata,
        (ctx.to(m), 16, 132),
    )
    # NumPy 2's bool calls itself "bool": the message names its module
    unsorted_np = functools.partial(flash_mla.topk_indices, sorted=np.bool_(False))
    yield "sorted: expected a bool, got numpy.bool", TypeError, unsorted_np, (torch.zeros(2, 5), 2)


@pytest.mark.parametrize("match, exc, fn, args", list(_bad_calls()), ids=lambda v: v if isinstance(v, str) else "")
def test_bad_arguments_raise_naming_them(match, exc, fn, args):
    with pytest.raises(exc, match="^" + match):
        fn(*args)


# ------------------------------------------------------------------------------ operators


def test_operators_opcheck_and_compile():
    nb, bs, d = 4, 16, 64
    cache = empty_cache(nb, bs, d)
    k = random_keys(6, d, seed=20)
    slots = torch.tensor([0, 5, 17, -1, 40, 63], device=DEVICE)
    res = torch.library.opcheck(torch.ops.sparse_mla.indexer_k_quant_and_cache.default, (k, cache, slots, "ue8m0"))
    assert all(v == "SUCCESS" for v in res.values()), res
    q = random_q((2, 2, 8, d), seed=21)
    w = torch.rand(4, 8, device=DEVICE)
    ctx = torch.tensor([30, 7], dtype=torch.int32, device=DEVICE)
    table = torch.tensor([[1, 3], [2, 0]], dtype=torch.int32, device=DEVICE)
    meta = flash_mla.get_paged_mqa_logits_metadata(ctx, bs, 132)
    args = (q.view(torch.uint8).view(torch.float8_e4m3fn), cache, w, ctx, table, meta, 32)
    # (opcheck's schema test compares fp8 inputs with an op PyTorch lacks for fp8: the others run)
    res = torch.library.opcheck(
        torch.ops.sparse_mla.fp8_paged_mqa_logits.default,
        args,
        test_utils=("test_faketensor", "test_aot_dispatch_dynamic"),
    )
    assert all(v == "SUCCESS" for v in res.values()), res
    logits = flash_mla.fp8_paged_mqa_logits(*args)
    res = torch.library.opcheck(torch.ops.sparse_mla.topk_indices.default, (logits, 5))
    assert all(v == "SUCCESS" for v in res.values()), res

    def step(q, cache, w, ctx, table, meta):
        lg = torch.ops.sparse_mla.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, 32)
        return torch.ops.sparse_mla.topk_indices(lg, 5)

    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*args[:6])
    assert torch.equal(got, flash_mla.topk_indices(logits, 5))
    res = torch.library.opcheck(torch.ops.sparse_mla.topk_indices.default, (logits, 5, None, None, False))
    assert all(v == "SUCCESS" for v in res.values()), res
    unsorted = torch.compile(lambda x: flash_mla.topk_indices(x, 5, sorted=False), fullgraph=True, backend="aot_eager")
    assert same_index_sets(unsorted(logits), flash_mla.topk_indices(logits, 5))

    # the Python functions themselves compile to the operators
    def api_step(k, cache, slots, q, w, ctx, table, meta):
        flash_mla.indexer_k_quant_and_cache(k, cache, slots)
        lg = flash_mla.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, 32)
        return flash_mla.topk_kvcache_indices(lg, 5, table, bs, 2)

    c1, c2 = empty_cache(nb, bs, d), empty_cache(nb, bs, d)
    got = torch.compile(api_step, fullgraph=True, backend="aot_eager")(k, c1, slots, *args[:1], w, ctx, table, meta)
    want = api_step(k, c2, slots, *args[:1], w, ctx, table, meta)
    assert torch.equal(got, want) and torch.equal(c1, c2)

    # a bad argument raises the library's own exception under fullgraph=True, not Dynamo's
    def compiled(fn, *a):
        torch._dynamo.reset()
        return torch.compile(fn, fullgraph=True, backend="aot_eager")(*a)

    bad_calls = [
        (TypeError, "^k: expected an int", lambda x: flash_mla.topk_indices(x, True), logits),
        (TypeError, "^sorted: expected a bool", lambda x: flash_mla.topk_indices(x, 3, sorted=1), logits),
        (ValueError, "^next_n: expected an int", lambda x: flash_mla.topk_kvcache_indices(x, 3, table, bs, 0), logits),
        (ValueError, "^logits: rows \\(4\\) must be b \\* next_n", lambda x: flash_mla.topk_kvcache_indices(x, 3, table, bs, 3), logits),
        (ValueError, "^max_context_len: expected", lambda x: flash_mla.fp8_paged_mqa_logits(x, cache, w, ctx, table, meta, -1), args[0]),
        (TypeError, "^clean_logits: expected a bool", lambda x: flash_mla.fp8_paged_mqa_logits(x, cache, w, ctx, table, meta, 32, 1), args[0]),
        (TypeError, "^kv: expected a tuple", lambda x: flash_mla.fp8_mqa_logits(x, cache, w, ctx, ctx), args[0][0]),
        (ValueError, "^scale_fmt: expected", lambda x: flash_mla.indexer_k_quant_and_cache(x, c1, slots, "e4m3"), k),
    ]  # fmt: skip
    for exc, msg, fn, arg in bad_calls:
        with pytest.raises(exc, match=msg):
            compiled(fn, arg)
    with pytest.raises(ValueError, match="^logits: expected a 2-D tensor"):
        compiled(lambda x: flash_mla.topk_indices(x, 3), logits[0])
    # a Python int that took two values is a symbolic size: its bad value still raises ours
    torch._dynamo.reset()
    dyn = torch.compile(lambda x, kk: flash_mla.topk_indices(x, kk), fullgraph=True, backend="aot_eager")
    assert torch.equal(dyn(logits, 4), flash_mla.topk_indices(logits, 4))
    assert torch.equal(dyn(logits, 6), flash_mla.topk_indices(logits, 6))
    with pytest.raises(ValueError, match="^k: expected an int in"):
        dyn(logits, 0)
    dyn_len = torch.compile(
        lambda x, n: flash_mla.fp8_paged_mqa_logits(x, cache, w, ctx, table, meta, n),
        fullgraph=True,
        backend="aot_eager",
    )
    dyn_len(args[0], 32)
    dyn_len(args[0], 40)
    with pytest.raises(ValueError, match="^max_context_len: expected"):
        dyn_len(args[0], -1)
    # the cache write compiles to its operator (its checks run with it), and its scalars raise ours
    torch._dynamo.reset()
    c3, c4 = empty_cache(nb, bs, d), empty_cache(nb, bs, d)
    torch.compile(lambda *a: flash_mla.indexer_k_quant_and_cache(*a), fullgraph=True, backend="aot_eager")(k, c3, slots)
    flash_mla.indexer_k_quant_and_cache(k, c4, slots)
    assert torch.equal(c3, c4)
    with pytest.raises(TypeError, match="^q: expected dtype"):
        compiled(lambda x: flash_mla.fp8_paged_mqa_logits(x, cache, w, ctx, table, meta, 32), args[0].float())
    kvb = random_q((20, d), seed=22)
    sc = torch.rand(20, device=DEVICE)
    r0 = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    r1 = torch.tensor([20, 3], dtype=torch.int32, device=DEVICE)
    assert torch.equal(
        torch.ops.sparse_mla.fp8_mqa_logits(q[0], kvb, sc, w[:2], r0, r1),
        flash_mla.fp8_mqa_logits(q[0], (kvb, sc), w[:2], r0, r1),
    )


def test_index_cache_sliced_by_tokens_is_refused():
    """A view keeping part of each block's tokens would read and write the scales of other token
    rows (they follow the block's full page): refused by every call that takes the cache, naming
    it; whole-block views stay accepted."""
    nb, bs, d = 4, 16, 64
    cache = empty_cache(nb, bs, d)
    k = random_keys(3, d, seed=30)
    slots = torch.tensor([0, 5, 17], device=DEVICE)
    flat = torch.zeros(nb * bs * (d + 4), dtype=torch.uint8, device=DEVICE).view(nb, bs, 1, d + 4)
    for sliced in (cache[:, :8], cache[:1, :8], flat[:, :8], flat[:, :8].view(torch.int8).view(torch.uint8)):
        with pytest.raises(ValueError, match="^kv_cache: blocks of 8 tokens start every 16 token rows"):
            flash_mla.indexer_k_quant_and_cache(k[:1], sliced, slots[:1])
        ctx = torch.tensor([8], dtype=torch.int32, device=DEVICE)
        meta = flash_mla.get_paged_mqa_logits_metadata(ctx, 8, 132)
        q = random_q((1, 1, 8, d), seed=31)
        table = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
        w = torch.rand(1, 8, device=DEVICE)
        with pytest.raises(ValueError, match="^kv_cache: blocks of 8 tokens"):
            flash_mla.fp8_paged_mqa_logits(q, sliced, w, ctx, table, meta, 8)
    flash_mla.indexer_k_quant_and_cache(k, cache[1:3], slots % 32)  # whole blocks: fine


def test_nan_query_bytes_give_nan_logits_on_the_default_path():
    # e4m3 NaN bytes (0x7F / 0xFF: a NaN activation cast to float8) in a query: the twin's logits of
    # that row are NaN wherever a key is visible; the kernels' default path must agree (on a CPU
    # that is the exact integer decode: the interpreter's FP8 dots read those bytes as +-480)
    d, h, s_kv = 32, 4, 96
    q = random_q((3, h, d), seed=41)
    q.view(torch.uint8)[0, 1, 5] = 0x7F
    q.view(torch.uint8)[2, 0, 0] = 0xFF
    kv = random_q((s_kv, d), seed=42)
    sc = torch.rand(s_kv, device=DEVICE) + 0.5
    w = torch.rand(3, h, device=DEVICE) + 0.1
    ks = torch.tensor([0, 10, 0], dtype=torch.int32, device=DEVICE)
    ke = torch.tensor([96, 50, 1], dtype=torch.int32, device=DEVICE)
    got = flash_mla.fp8_mqa_logits(q, (kv, sc), w, ks, ke)
    want = fp8_mqa_logits_reference(q, kv, sc, w, ks, ke)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and bool(torch.isnan(want[0]).any())
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got))


@needs_kernels
def test_the_key_scale_multiplies_the_weighted_relu_sum():
    # the model's order (DeepSeek-V3.2's formula, DeepGEMM's): scale[j] · Σ_h w · relu(q · k[j]); for a negative
    # scale (never written by the quantiser) it differs from Σ_h w · relu(q · k · scale), and the
    # kernels follow the twin
    g = torch.Generator().manual_seed(7)
    h, d = 4, 32
    q = torch.randn(3, h, d, generator=g).to(torch.float8_e4m3fn).to(DEVICE)
    keys = torch.randn(6, d, generator=g).to(torch.float8_e4m3fn).to(DEVICE)
    sc = torch.tensor([0.5, -0.25, 2.0, -1.0, 0.0, 1.0], device=DEVICE)
    w = torch.randn(3, h, generator=g).abs().to(DEVICE)
    ks = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    ke = torch.full((3,), 6, dtype=torch.int32, device=DEVICE)
    got = flash_mla.fp8_mqa_logits(q, (keys, sc), w, ks, ke)
    want = fp8_mqa_logits_reference(q, keys, sc, w, ks, ke)
    s = torch.einsum("qhd,kd->qhk", q.float().cpu(), keys.float().cpu())
    by_hand = (s.relu() * w.cpu().unsqueeze(-1)).sum(1) * sc.cpu()
    torch.testing.assert_close(want.cpu(), by_hand, rtol=1e-6, atol=1e-6)
    assert (want[:, [1, 3]] <= 0).all() and (want[:, 4] == 0).all()
    close_to(got, want, fp8_mqa_logits_reference(abs_e4m3(q), abs_e4m3(keys), sc.abs(), w, ks, ke), d=d)


@needs_kernels
@pytest.mark.parametrize("h", [3, 5])
def test_an_inf_key_scale_with_padded_heads_matches_the_twin(h):
    # H not a power of two: the kernels' padded head rows (zero queries) must add nothing to a
    # key's sum, which its inf scale then multiplies (model order: scale · Σ_h w · relu(q · k)):
    # a positive sum gives +inf, a zero sum (every score negative) gives NaN, never a padded row's NaN
    d = 16
    keys = torch.tensor([1.0, 1.0, -1.0, -1.0]).repeat_interleave(d).view(4, d).to(torch.float8_e4m3fn).to(DEVICE)
    sc = torch.tensor([float("inf"), 1.0, float("inf"), 0.5], device=DEVICE)
    q = torch.ones(2, h, d).to(torch.float8_e4m3fn).to(DEVICE)
    w = torch.ones(2, h, device=DEVICE)
    ks = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    ke = torch.full((2,), 4, dtype=torch.int32, device=DEVICE)
    got = flash_mla.fp8_mqa_logits(q, (keys, sc), w, ks, ke)
    want = fp8_mqa_logits_reference(q, keys, sc, w, ks, ke)
    expect = torch.tensor([float("inf"), 16.0 * h, float("nan"), 0.0], device=DEVICE).expand(2, 4)
    torch.testing.assert_close(want, expect, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    # the paged form: the same keys and scales written into a one-block cache
    cache = torch.zeros(1, 4, 1, d + 4, dtype=torch.uint8, device=DEVICE)
    flat = cache.view(-1)
    flat[: 4 * d] = keys.view(torch.uint8).reshape(-1)
    flat[4 * d : 4 * d + 16] = sc.view(torch.uint8)
    qp = q[:1].unsqueeze(0)  # [b=1, next_n=1, H, D]
    ctx = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    meta = flash_mla.get_paged_mqa_logits_metadata(ctx, 4, 1)
    got = flash_mla.fp8_paged_mqa_logits(qp, cache, w[:1], ctx, bt, meta, 4)
    want = fp8_paged_mqa_logits_reference(qp, cache, w[:1], ctx, bt, 4)
    torch.testing.assert_close(want, expect[:1], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_block_table_views_the_kernels_cannot_read_are_refused():
    # a table whose elements run past its storage (read out of bounds before), and a lazily negated
    # view (the kernels read the raw bits: silently other slots before)
    bt = torch.arange(10, dtype=torch.int32).view(2, 5)
    bt.untyped_storage().resize_(8)
    with pytest.raises(ValueError, match="block_table: its elements run"):
        flash_mla.topk_kvcache_indices(torch.randn(4, 80), 80, bt, 16, 2)
    neg = torch._neg_view(-torch.arange(10, dtype=torch.int32).view(2, 5))
    with pytest.raises(ValueError, match="block_table: a lazily negated"):
        flash_mla.topk_kvcache_indices(torch.arange(80.0).repeat(4, 1), 2, neg, 16, 2)
    got = flash_mla.topk_kvcache_indices(torch.arange(80.0).repeat(4, 1), 2, neg.resolve_neg(), 16, 2)
    assert got[1, 0].tolist() == [159, 158]


@pytest.mark.parametrize(
    "cache, err",
    [
        (torch.zeros(2, 16, 1, 36), TypeError),
        (torch.zeros(2, 16, 2, 36, dtype=torch.uint8), ValueError),
        (torch.zeros(2, 16, 1, 9, dtype=torch.uint8), ValueError),
        (torch.zeros(2, 16, 36, dtype=torch.uint8), ValueError),
        ("cache", TypeError),
    ],
)
def test_dequantize_indexer_cache_checks_its_argument(cache, err):
    with pytest.raises(err, match="kv_cache"):
        flash_mla.dequantize_indexer_cache(cache)


def test_dequantize_indexer_cache_returns_the_stored_keys():
    k = torch.randn(5, 32)
    cache = torch.zeros(2, 4, 1, 36, dtype=torch.uint8)
    flash_mla.indexer_k_quant_and_cache(k, cache, torch.tensor([0, 3, 4, 6, 7]), scale_fmt=None)
    keys, scales = flash_mla.dequantize_indexer_cache(cache)
    assert keys.shape == (8, 32) and scales.shape == (8,)
    got = keys[[0, 3, 4, 6, 7]] * scales[[0, 3, 4, 6, 7]].unsqueeze(1)
    torch.testing.assert_close(got, k, rtol=0.07, atol=1e-3)  # e4m3: 3 mantissa bits


# the split path at interpreter sizes: chunks of 64 entries, lists of up to 2 x k (at least 64), a 64-entry sample
SPLIT_SMALL = {
    "split": 256, "split_chunk": 64, "split_warps": 1, "split_list_warps": 2, "split_cap": 2, "split_sample": 64,
    "bisect": 4096, "bisect_warps": 4,
}  # fmt: skip


def _split_rows(n: int, levels: int, g: torch.Generator) -> torch.Tensor:
    """Rows the split path must get right: tied values, distinct values, a ramp (the best at the
    end), a block of recent positions above the rest, one value everywhere (more than the list)."""
    x = torch.randint(0, levels, (6, n), generator=g).float() - levels / 2
    x[1] = torch.randn(n, generator=g)
    x[2] = torch.randn(n, generator=g) + torch.linspace(0, 6, n)
    x[3] = torch.randn(n, generator=g)
    x[3, -max(n // 16, 1) :] += 4
    x[4] = 0.25
    x[5] = -torch.arange(n).float()  # the best at the start
    return x


@pytest.mark.skipif(not KERNELS, reason="runs the Triton kernels (a GPU or TRITON_INTERPRET=1)")
@settings(max_examples=8, deadline=None)
@given(
    st.integers(256, 1500),  # n (every row takes the split path: n >= SPLIT_SMALL["split"])
    st.integers(1, 200),  # k
    st.integers(1, 30),  # distinct levels of row 0
    st.booleans(),  # specials (NaN, +-inf, -0.0)
    st.booleans(),  # a block table (cache slots)
    st.integers(0, 2**31 - 1),  # seed
)
def test_topk_split_path_random_rows_match_twin(n, k, levels, specials, slots, seed):
    # the split path (threshold from a sample, positions by chunk, the list, the radix select over
    # the row for flagged rows) on rows of every kind and random ranges: rank order equal to the twin, no
    # order the same set, the same order on a second call, slots through a block table
    from sparse_mla.indexer.kernels import launch_topk

    g = torch.Generator().manual_seed(seed)
    x = _split_rows(n, levels, g)
    rows = x.shape[0]
    if specials:
        for v in (float("nan"), float("inf"), float("-inf"), -0.0):
            x[torch.rand(rows, n, generator=g) < 0.03] = v
    lo = torch.randint(-3, n // 4 + 1, (rows,), generator=g)
    hi = lo + torch.randint(0, n + 4, (rows,), generator=g)
    lo[:3], hi[:3] = 0, n
    lo_d, hi_d = lo.clamp(0, n).to(DEVICE), torch.maximum(hi.clamp(0, n), lo.clamp(0, n)).to(DEVICE)
    want = topk_indices_reference(x, k, lo_d.cpu(), hi_d.cpu())
    kk = min(k, n)
    kk_p2 = 1 << (kk - 1).bit_length()
    table, pbs = None, 1
    if slots:
        pbs = 16
        table = torch.randint(-1, 100, (rows, n // pbs), generator=g, dtype=torch.int32)  # the last entries unmapped
        want = abs_indices_to_kvcache_indices(want.view(rows, 1, k), table, pbs).view(rows, k)
        table = table.to(DEVICE)
    out = torch.full((rows, k), -7, dtype=torch.int32, device=DEVICE)
    launch_topk(x.to(DEVICE), lo_d, hi_d, out, k, kk, table, pbs, config=SPLIT_SMALL)
    assert torch.equal(out.cpu()[:, :kk_p2], want[:, :kk_p2])
    unsorted = [torch.full((rows, k), -7, dtype=torch.int32, device=DEVICE) for _ in range(2)]
    for u in unsorted:
        launch_topk(x.to(DEVICE), lo_d, hi_d, u, k, kk, table, pbs, config=SPLIT_SMALL, ordered=False)
    # (as multisets: slots repeat where table entries do)
    assert torch.equal(unsorted[0].cpu()[:, :kk_p2].sort(-1).values, want[:, :kk_p2].sort(-1).values)
    assert torch.equal(unsorted[0][:, :kk_p2], unsorted[1][:, :kk_p2])


@needs_kernels
def test_topk_split_path_lists_and_flags():
    # which rows the split path finishes from its list and which it flags (and does by the radix
    # select over the row): rows of distinct values (a sample judges them) on the list, a row of one
    # value (more candidates than the list holds) and a row whose top keys the sample misses
    # flagged; the answer right for all
    from sparse_mla.indexer.kernels import topk as K

    g = torch.Generator().manual_seed(3)
    n, k = 1024, 40
    x = _split_rows(n, 8, g)
    x[0] = torch.randn(n, generator=g)  # distinct values
    x[4] = 0.25  # one value: 1024 candidates > the list's 128
    x[5] = torch.randn(n, generator=g)
    x[5, 1::16] += 10  # 64 top keys between the sample's segments (16 entries every 16): the sample sees none
    cfg = K.topk_config(SPLIT_SMALL)
    k_p2, n_p2 = 64, 1024
    xd = x.to(DEVICE)
    out = torch.full((6, k), -7, dtype=torch.int32, device=DEVICE)
    scr = torch.empty(6, k_p2, dtype=torch.int64, device=DEVICE)
    flags = K.launch_topk_split(xd, None, None, out, scr, k, k_p2, n_p2, out, False, 1, 1, False, cfg)
    assert flags.cpu().tolist() == [0, 0, 0, 0, 1, 1]
    want = topk_indices_reference(x, k, None, None)
    assert same_index_sets(out.cpu(), want)
    got = torch.empty(6, k, dtype=torch.int32, device=DEVICE)
    K.launch_topk(xd, None, None, got, k, k, config=SPLIT_SMALL, ordered=False)
    assert torch.equal(got.cpu(), out.cpu())  # (the public call is these launches)


# k 4096 on each top-k path (n: the smallest rows that take it at the default TOPK_CONFIG, which
# `cfg` changes): the register path (n_p2 8192 <= bisect, n < split), with its list of 2 k (the whole
# row) or of k (bisect_cap 1: rows with more keys at or above the top bits take the select pass over
# the row); the split path at n == split (its list of 2 k holds the whole row) and with a list of k
# (split_cap 1: rows the sample misjudges flagged, finished by the radix select over the row)
K4096_PATHS = {
    "register": (6000, {}),
    "register-cap1": (6000, {"bisect_cap": 1}),
    "split": (8192, {}),
    "split-cap1": (8192, {"split_cap": 1}),
}


def _k4096_rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """8 rows of ``n`` for k 4096: ties at the k-th key, NaN / +-inf / -0.0, and ranges of fewer
    than k keys (-1 padding), of exactly k, of k + 1 and of none."""
    g = torch.Generator().manual_seed(seed)
    k = 4096
    x = (torch.randint(0, 12, (8, n), generator=g).float() - 6) / 4  # 12 levels: ties everywhere
    x[1] = torch.randn(n, generator=g).clamp(-4, 4)
    x[1, 100:2100] += 10  # 2000 above a block of 3000 tied keys: 2096 of them taken, by position
    x[1, 2500:5500] = 5.0
    x[2, torch.arange(n) % 3 != 2] = float("nan")  # fewer than k non-NaN keys: the k-th among the NaN
    x[2, 2::9] = float("inf")
    x[2, 5::9] = float("-inf")
    x[2, 8::9] = -0.0
    x[6] = 0.5  # one value: k + 1 tied keys, the last dropped
    lo = torch.zeros(8, dtype=torch.int64)
    hi = torch.full((8,), n, dtype=torch.int64)
    lo[3], hi[3] = 100, 3100  # 3000 keys: 1096 entries -1
    lo[4], hi[4] = n // 2, n // 2  # empty
    lo[5], hi[5] = n - k, n + 50  # exactly k keys (the end clamped to n)
    lo[6], hi[6] = 7, 7 + k + 1
    lo[7], hi[7] = -20, k - 1  # k - 1 keys (the start clamped to 0): one -1
    return x, lo, hi


@needs_kernels
@pytest.mark.parametrize("path", list(K4096_PATHS))
def test_topk_k4096_sets_match_twin(path, monkeypatch):
    # k 4096 (the largest k the top-k takes): topk_indices and topk_kvcache_indices without
    # the final sort (the interpreter's sort of 4096 keys is slow: rank order in the test below)
    # give the twin's sets, ties by position and -1 padding included
    from sparse_mla.indexer.kernels import topk as K

    n, cfg = K4096_PATHS[path]
    monkeypatch.setattr(K, "TOPK_CONFIG", dataclasses.replace(K.TOPK_CONFIG, **cfg))
    k, next_n, pbs = 4096, 2, 64
    x, lo, hi = _k4096_rows(n, seed=n + len(cfg))
    want = topk_indices_reference(x, k, lo, hi)
    assert (want == -1).sum(1).tolist() == [0, 0, 0, 1096, k, 0, 0, 1]
    tied = torch.cat([torch.arange(100, 2100), torch.arange(2500, 2500 + k - 2000)]).int()
    assert torch.equal(want[1].sort().values, tied) and torch.equal(want[6], torch.arange(7, 7 + k).int())
    xd, lod, hid = x.to(DEVICE), lo.to(DEVICE), hi.to(DEVICE)
    got = flash_mla.topk_indices(xd, k, lod, hid, sorted=False)
    assert got.shape == (8, k) and same_index_sets(got, want)
    # the fused slot map through a block table of distinct blocks (so the slots are distinct too), on
    # the tied row and a padded one (two rows: the interpreter's split path takes ~1 s a row)
    r = [1, 3]
    b, pages = len(r) // next_n, -(-n // pbs)
    table = torch.randperm(b * pages, generator=torch.Generator().manual_seed(n)).view(b, pages).int()
    slots = flash_mla.topk_kvcache_indices(xd[r], k, table.to(DEVICE), pbs, next_n, lod[r], hid[r], sorted=False)
    want_slots = abs_indices_to_kvcache_indices(want[r].view(b, next_n, k), table, pbs)
    assert slots.shape == (b, next_n, k) and same_index_sets(slots, want_slots)


@needs_kernels
@pytest.mark.parametrize("path, row, fused", [("register", 1, False), ("split", 2, True)])
def test_topk_k4096_rank_order_matches_twin(path, row, fused, monkeypatch):
    # k 4096 in rank order (the kernels' sort of 4096 rank keys), one row each (the interpreter sorts
    # 4096 keys in ~15 s): the row with 2096 of 3000 tied keys taken by position, and the row of NaN,
    # +-inf and -0.0 whose k-th key lies among the NaN, as slots of a one-request block table
    from sparse_mla.indexer.kernels import topk as K

    n, cfg = K4096_PATHS[path]
    monkeypatch.setattr(K, "TOPK_CONFIG", dataclasses.replace(K.TOPK_CONFIG, **cfg))
    k, pbs = 4096, 16
    x, _, _ = _k4096_rows(n, seed=n + len(cfg))
    x = x[row : row + 1]
    want = topk_indices_reference(x, k)
    if not fused:
        got = flash_mla.topk_indices(x.to(DEVICE), k)
        assert torch.equal(got.cpu(), want)
        return
    table = torch.randperm(n // pbs + 3, generator=torch.Generator().manual_seed(row))[: n // pbs].view(1, -1).int()
    got = flash_mla.topk_kvcache_indices(x.to(DEVICE), k, table.to(DEVICE), pbs)
    assert torch.equal(got.cpu(), abs_indices_to_kvcache_indices(want.view(1, 1, k), table, pbs))
    assert torch.isnan(x[0, int(want[0, -1])]) and torch.isinf(x[0, int(want[0, 0])])  # +inf first, NaN last


@pytest.mark.skipif(
    not ON_GPU, reason="the direct launcher runs compiled kernels (the interpreter takes Triton's path)"
)
@pytest.mark.parametrize("n", [8192, 4096])  # the split path (its three launches), the register path
def test_topk_repeated_calls_through_the_direct_launcher(n, monkeypatch):
    # the second and later calls of a shape go straight to the compiled kernels with the new
    # call's tensors (other logits, other output buffers): the same sets as the twin each time,
    # and the same as Triton's own launch path
    from sparse_mla.core import launcher

    g = torch.Generator().manual_seed(n)
    xs = [torch.randn(5, n, generator=g) for _ in range(3)]
    lo = torch.tensor([0, 3, 100, 0, 7], dtype=torch.int32)
    hi = torch.tensor([n, n - 5, n, 3000, n // 2], dtype=torch.int32)
    got = []
    for x in xs:
        for ordered in (True, False):
            out = flash_mla.topk_indices(
                x.to(DEVICE), 300, row_starts=lo.to(DEVICE), row_ends=hi.to(DEVICE), sorted=ordered
            )
            want = topk_indices_reference(x, 300, lo, hi)
            if ordered:
                assert torch.equal(out.cpu(), want)
            else:
                assert same_index_sets(out.cpu(), want)
            got.append(out.cpu())
    assert launcher.direct_launch_enabled()
    monkeypatch.setenv("SPARSE_MLA_DIRECT_LAUNCH", "0")
    again = flash_mla.topk_indices(
        xs[-1].to(DEVICE), 300, row_starts=lo.to(DEVICE), row_ends=hi.to(DEVICE), sorted=False
    )
    assert torch.equal(again.cpu(), got[-1])
