"""Fused quantise-and-store kernel (``sparse_mla.kvcache.kernels.store``) vs ``quantize_k_cache``, byte for byte.

Every test pre-fills the whole cache storage with random bytes, writes random bf16 tokens to
random distinct slots, and compares the *whole storage* with the expected bytes built from
:func:`sparse_mla.quantize_k_cache` on the same values (``tests/cache_bytes.py`` places
them by docs/design.md §4's offsets), so untouched slots, MODEL1 padding and neighbouring layers of a pool
are checked too. On the CPU the Triton kernel runs in the interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch
from cache_bytes import expected_after_store, quantized_token_bytes, storage_bytes, to_device

from sparse_mla import dequantize_k_cache, get_layout, quantize_and_store_kv, quantize_k_cache
from sparse_mla.kvcache.kernels.store import launch as launch_store_kernel
from sparse_mla.reference import quantize_and_store_kv_reference

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1",
    reason="kernels need a GPU or TRITON_INTERPRET=1 (set before starting pytest)",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def sb(k_cache: torch.Tensor) -> torch.Tensor:
    """The cache's whole storage as flat uint8 on the CPU."""
    return storage_bytes(k_cache).cpu()


def random_tokens(n: int, d_qk: int, seed: int) -> torch.Tensor:
    """``[n, d_qk]`` bf16 with a magnitude of its own per token and 64-value tile (10^-6 .. 10^3)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_qk, generator=g)
    mag = 10.0 ** (torch.rand(n, d_qk // 64, generator=g) * 9 - 6)
    return (x * mag.repeat_interleave(64, dim=1)).to(torch.bfloat16).to(DEV)


def random_cache(layout: str, nb: int, pbs: int, dtype: torch.dtype, seed: int, pool_layers: int = 1, layer: int = 0):
    """A cache whose whole storage holds random bytes.

    ``pool_layers > 1``: the cache is layer ``layer`` of a pool interleaving layers per token (V32:
    token stride ``pool_layers * 656``) or per block (MODEL1: block stride ``pool_layers * padded``).
    """
    lay = get_layout(layout)
    g = torch.Generator().manual_seed(seed)
    if lay.name == "V32":
        pool = torch.randint(0, 256, (nb, pbs, pool_layers, 656), generator=g, dtype=torch.uint8)
        kc = pool[:, :, layer : layer + 1, :]
    else:
        bb = lay.block_bytes(pbs)
        pool = torch.randint(0, 256, (nb, pool_layers, bb), generator=g, dtype=torch.uint8)
        kc = pool.as_strided((nb, pbs, 1, 584), (pool_layers * bb, 584, 584, 1), layer * bb)
    kc = to_device(kc, DEV)
    return kc if dtype == torch.uint8 else kc.view(dtype)


def distinct_slots(n: int, n_slots: int, seed: int, skip_frac: float = 0.2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.randperm(n_slots, generator=g)[:n].clone()
    s[torch.rand(n, generator=g) < skip_frac] = -1
    s[int(torch.randint(0, n, (1,), generator=g))] = -1  # at least one skipped token
    return s.to(torch.int64).to(DEV)


CASES = [
    # layout, page_block_size, num_blocks, cache dtype, pool layers, block_t
    ("V32", 5, 4, torch.float8_e4m3fn, 1, 1),
    ("V32", 3, 5, torch.uint8, 3, 4),  # layer 1 of a token-interleaved pool
    ("MODEL1", 3, 5, torch.float8_e4m3fn, 1, 2),
    ("MODEL1", 7, 3, torch.uint8, 1, 1),  # odd page size (a block-interleaved MODEL1 pool is refused)
]


@pytest.mark.parametrize("layout,pbs,nb,dtype,layers,block_t", CASES)
def test_store_is_byte_identical_to_quantize_k_cache(layout, pbs, nb, dtype, layers, block_t):
    lay = get_layout(layout)
    seed = zlib.crc32(f"{layout}-{pbs}-{nb}-{layers}".encode()) % 1000
    kc = random_cache(layout, nb, pbs, dtype, seed, pool_layers=layers, layer=layers // 2)
    n = min(nb * pbs, 12)
    kv = random_tokens(n, lay.d_qk, seed + 1)
    slots = distinct_slots(n, nb * pbs, seed + 2)
    assert (slots == -1).any() and (slots >= 0).sum() >= n // 2
    before = sb(kc).clone()
    want = expected_after_store(kc, kv, slots)
    quantize_and_store_kv(kv, slots, kc, block_t=block_t)
    got = sb(kc)
    assert torch.equal(got, want), f"{int((got != want).sum())} bytes differ"
    # the write changed something, and only inside the written slots' records
    assert not torch.equal(got, before)
    # the PyTorch twin does the same
    kc2 = random_cache(layout, nb, pbs, dtype, seed, pool_layers=layers, layer=layers // 2)
    quantize_and_store_kv_reference(kv, slots, kc2)
    assert torch.equal(sb(kc2), want)


def test_store_int32_slots_and_strided_kv_rows():
    lay = get_layout("V32")
    kc = random_cache("V32", 4, 4, torch.float8_e4m3fn, 7)
    wide = random_tokens(5, 2 * lay.d_qk, 8)
    kv = wide[:, 100 : 100 + lay.d_qk]  # row stride 1152, not contiguous
    slots = torch.tensor([15, 0, -1, 9, 4], dtype=torch.int32, device=DEV)
    want = expected_after_store(kc, kv, slots)
    quantize_and_store_kv(kv, slots, kc)
    assert torch.equal(sb(kc), want)


def _corner_tokens(d_qk: int, tile: int) -> torch.Tensor:
    """Tiles at the edges of the UE8M0 / e4m3 rules, one per tile of a few tokens."""
    g = torch.Generator().manual_seed(3)
    n_tiles = (d_qk - 64) // tile
    toks = []

    def tile_with(amax: float, fill: str = "rand") -> torch.Tensor:
        t = (torch.rand(tile, generator=g) * 2 - 1) * amax
        if fill == "zero":
            t = torch.zeros(tile)
        t[tile // 3] = amax
        t[tile // 2] = -amax
        return t

    pieces = [
        torch.zeros(tile),  # all zero: scale 2^-13 (the 1e-4 floor)
        -torch.zeros(tile),  # negative zeros
        tile_with(448.0),  # scale exactly 1
        tile_with(448.0 * 2.0**5),  # amax = 448 * 2^j: scale 2^j, not 2^(j+1)
        tile_with(448.0 * 2.0**-7),
        tile_with(float(torch.tensor(448.0 * 2.0**3).bfloat16().float()) * (1 + 2**-7)),  # next bf16 above
        tile_with(448.0 * 1e-4),  # amax / 448 = 1e-4: at the floor
        tile_with(448.0 * 0.9e-4),  # below the floor
        tile_with(1e-30),  # tiny: everything rounds into e4m3 subnormals / 0
        tile_with(2.0**-120),
        tile_with(0.75),  # the walkthrough's example: scale 2^-9
        tile_with(3.0e38 / 2),  # huge but finite
        tile_with(1.0, "zero"),  # one value, rest zero
    ]
    # values that fall exactly between two e4m3 numbers after scaling (ties to even)
    ties = torch.tensor(
        [
            448.0,
            1.0625,
            1.1875,
            2.0**-7 * 1.0625,
            2.0**-9 * 0.5,
            2.0**-9 * 1.5,
            2.0**-9 * 2.5,
            2.0**-10,
            3 * 2.0**-10,
            2.0**-6 * (1 - 2**-5),
        ]
    )
    t = torch.zeros(tile)
    t[: ties.numel()] = ties
    t[ties.numel() : 2 * ties.numel()] = -ties
    pieces.append(t)
    n_tok = -(-len(pieces) // n_tiles)
    for i in range(n_tok):
        row = []
        for j in range(n_tiles):
            k = i * n_tiles + j
            row.append(pieces[k] if k < len(pieces) else tile_with(float(10 ** (k % 7 - 3))))
        row.append(torch.randn(64, generator=g))
        toks.append(torch.cat(row))
    return torch.stack(toks).to(torch.bfloat16)


@pytest.mark.parametrize("layout", ["V32", "MODEL1"])
def test_store_corner_tiles(layout):
    lay = get_layout(layout)
    kv = _corner_tokens(lay.d_qk, lay.tile).to(DEV)
    n = kv.shape[0]
    kc = random_cache(layout, 2, 4, torch.uint8, 11)
    slots = torch.arange(n, dtype=torch.int64, device=DEV)
    want = expected_after_store(kc, kv, slots)
    quantize_and_store_kv(kv, slots, kc)
    assert torch.equal(sb(kc), want)
    # spot checks of the rules themselves on the quantize_k_cache side
    tb = quantized_token_bytes(kv)
    if layout == "V32":
        scales = tb[:, 512:528].contiguous().view(torch.float32)
        assert scales[0].tolist() == [2.0**-13, 2.0**-13, 1.0, 2.0**5]
        assert scales[1].tolist() == [2.0**-7, 2.0**4, 2.0**-13, 2.0**-13]
        assert scales[2, 2] == 2.0**-9  # amax 0.75 -> 2^-9 (the walkthrough's example)
        assert torch.all(tb[0, 128:256] == 0x80)  # -0.0 keeps its sign
    else:
        assert tb[0, 576:584].tolist() == [127 - 13, 127 - 13, 127, 127 + 5, 127 - 7, 127 + 4, 127 - 13, 0]


def test_store_exhaustive_e4m3_rounding():
    """Every bf16 value with |x| <= 448, in tiles whose amax is 448 (scale 1): e4m3 RTNE of each."""
    lay = get_layout("V32")
    pos = torch.arange(0, 0x43E1, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # 0 .. 448
    vals = torch.cat([pos, -pos]).float()
    per_tile = lay.tile - 1
    n_tiles = -(-vals.numel() // per_tile)
    vals = torch.cat([vals, torch.zeros(n_tiles * per_tile - vals.numel())]).view(n_tiles, per_tile)
    tiles = torch.cat([vals, torch.full((n_tiles, 1), 448.0)], dim=1)  # amax 448 in every tile
    n_tiles4 = -(-n_tiles // 4) * 4
    tiles = torch.cat([tiles, torch.full((n_tiles4 - n_tiles, lay.tile), 448.0)])
    nope = tiles.view(-1, 4 * lay.tile)
    kv = torch.cat([nope, torch.randn(nope.shape[0], 64)], dim=1).to(torch.bfloat16)
    assert torch.equal(kv[:, :512].float(), nope)  # the values are bf16-exact
    n = kv.shape[0]
    kc = random_cache("V32", n, 1, torch.float8_e4m3fn, 5)
    slots = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    quantize_and_store_kv(kv.to(DEV), slots.to(DEV), kc, block_t=16)
    got = sb(kc).view(n, 656)[slots][:, :512]
    want = nope.to(torch.float8_e4m3fn).view(torch.uint8)  # scale 1: plain RTNE cast
    assert torch.equal(got, want), f"{int((got != want).sum())} of {want.numel()} values differ"


def test_store_nothing_to_do_and_all_skipped():
    kc = random_cache("V32", 2, 4, torch.uint8, 2)
    before = sb(kc).clone()
    quantize_and_store_kv(
        torch.zeros(0, 576, dtype=torch.bfloat16, device=DEV), torch.zeros(0, dtype=torch.int64, device=DEV), kc
    )
    quantize_and_store_kv(random_tokens(3, 576, 1), torch.full((3,), -1, dtype=torch.int64, device=DEV), kc)
    assert torch.equal(sb(kc), before)


@pytest.mark.parametrize("layout", ["V32", "MODEL1"])
def test_kernel_masks_out_of_range_slots(layout):
    """What the GPU path does (no host check there): slots < 0 or >= num_slots are never written."""
    lay = get_layout(layout)
    kc = random_cache(layout, 3, 4, torch.uint8, 21)
    kv = random_tokens(6, lay.d_qk, 22)
    slots = torch.tensor([12, -5, 2, 1 << 40, -1, 11], dtype=torch.int64, device=DEV)  # 12 = num_slots
    want = expected_after_store(kc, kv, slots)  # writes only 2 and 11
    launch_store_kernel(kv, slots, kc, lay, 2)
    got = sb(kc)
    assert torch.equal(got, want)


def test_store_rejects_bad_arguments():
    # CPU tensors: the slot-range check runs on the host only when slot_mapping is on the CPU
    g = torch.Generator().manual_seed(3)
    kc = torch.randint(0, 256, (2, 4, 1, 656), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    kv = random_tokens(2, 576, 4).cpu()
    slots = torch.tensor([0, 1])
    before = storage_bytes(kc).clone()
    cases = [
        (TypeError, "kv", dict(kv=kv.float())),
        (TypeError, "kv", dict(kv=kv.tolist())),
        (ValueError, "kv", dict(kv=random_tokens(2, 512, 4))),  # d_qk of MODEL1 into a V32 cache
        (ValueError, "kv", dict(kv=kv[:, None])),
        (ValueError, "kv", dict(kv=random_tokens(2, 1152, 4)[:, ::2])),  # last dim not contiguous
        (TypeError, "slot_mapping", dict(slot_mapping=slots.float())),
        (ValueError, "slot_mapping", dict(slot_mapping=slots[:1])),
        (ValueError, "slot_mapping", dict(slot_mapping=torch.tensor([0, 8]))),  # 8 = num_slots
        (ValueError, "slot_mapping", dict(slot_mapping=torch.tensor([-2, 1]))),
        (TypeError, "k_cache", dict(k_cache=torch.zeros(2, 4, 1, 656, dtype=torch.bfloat16))),
        (ValueError, "k_cache", dict(k_cache=torch.zeros(2, 4, 1, 600, dtype=torch.uint8))),
        (ValueError, "k_cache", dict(k_cache=torch.zeros(2, 4, 1, 657, dtype=torch.uint8)[..., 1:])),  # misaligned
        (
            ValueError,
            "k_cache",
            dict(k_cache=torch.zeros(2 * 1752, dtype=torch.uint8).as_strided((2, 3, 1, 584), (1744, 584, 584, 1))),
        ),  # MODEL1 block stride below the 3 * 584 bytes used
        (ValueError, "layout", dict(layout="MODEL1")),
        (ValueError, "block_t", dict(block_t=3)),
    ]
    if torch.cuda.is_available():
        cases.append((ValueError, "kv", dict(kv=kv.cuda())))
        cases.append((ValueError, "slot_mapping", dict(slot_mapping=slots.cuda())))
    for exc, name, kw in cases:
        args = dict(kv=kv, slot_mapping=slots, k_cache=kc)
        args.update(kw)
        with pytest.raises(exc, match=f"^{name}"):
            quantize_and_store_kv(**args)
    assert torch.equal(storage_bytes(kc), before), "a rejected call wrote to the cache"


def test_store_then_dequantize_round_trip():
    """The written tokens dequantise (kvcache.dequantize_k_cache) to quantize_k_cache's values."""
    lay = get_layout("MODEL1")
    nb, pbs = 3, 4
    k = random_tokens(nb * pbs, lay.d_qk, 31)
    full = quantize_k_cache(k.cpu().view(nb, pbs, 1, lay.d_qk), "MODEL1")
    kc = random_cache("MODEL1", nb, pbs, torch.float8_e4m3fn, 32)
    quantize_and_store_kv(k, torch.arange(nb * pbs, device=DEV), kc)
    from sparse_mla import dequantize_k_cache

    assert torch.equal(dequantize_k_cache(kc, "MODEL1").cpu(), dequantize_k_cache(full, "MODEL1"))


@pytest.mark.parametrize("layout", ["V32", "MODEL1"])
def test_non_finite_values_are_stored_as_nan_bytes(layout):
    # NaN, +inf and -inf in the latent vector: the NaN byte 0x7F at that value, the rest of the tile
    # scaled by its finite values (the fused store byte-identical to quantize_k_cache); an attended
    # token holding one gives NaN, never a finite wrong value (+-inf used to be clamped to 448)
    lay = get_layout(layout)
    kv = random_tokens(6, lay.d_qk, 77)
    kv[0, 3] = float("inf")
    kv[1, lay.tile + 5] = float("-inf")
    kv[2, 0] = float("nan")
    kv[3, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 2.0])
    kv = kv.to(DEV)
    slots = torch.tensor([5, 0, 7, 2, 3, 6], dtype=torch.int64, device=DEV)
    kc = random_cache(layout, 2, 4, torch.uint8, 13)
    want = expected_after_store(kc, kv, slots)
    quantize_and_store_kv(kv, slots, kc)
    assert torch.equal(sb(kc), want)
    tb = quantized_token_bytes(kv)
    assert tb[0, 3] == 0x7F and tb[1, lay.tile + 5] == 0x7F and tb[2, 0] == 0x7F and tb[3, :3].tolist() == [0x7F] * 3
    deq = dequantize_k_cache(quantize_k_cache(kv.view(-1, 1, 1, lay.d_qk).cpu(), layout), layout).view(6, lay.d_qk)
    assert torch.isnan(deq[0, 3]) and torch.isnan(deq[1, lay.tile + 5]) and torch.isnan(deq[3, :3]).all()
    assert deq[3, 3] == 2.0  # the tile's scale comes from its finite values
    others = torch.ones_like(deq, dtype=torch.bool)
    others[0, 3] = others[1, lay.tile + 5] = others[2, 0] = False
    others[3, :3] = False
    assert torch.isfinite(deq[others]).all()


def test_store_compiles_fullgraph_and_raises_its_own_errors():
    """Under torch.compile(fullgraph=True) the store is its operator (the tensors checked when it
    runs); a bad scalar raises the library's exception, not Dynamo's."""
    kc = random_cache("V32", 4, 4, torch.float8_e4m3fn, 3)
    kc2 = kc.clone()
    kv = random_tokens(5, 576, 4)
    slots = torch.tensor([15, 0, -1, 9, 4], dtype=torch.int64, device=DEV)
    torch._dynamo.reset()
    torch.compile(lambda *a: quantize_and_store_kv(*a), fullgraph=True, backend="aot_eager")(kv, slots, kc)
    quantize_and_store_kv(kv, slots, kc2)
    assert torch.equal(sb(kc), sb(kc2))
    for kw, exc, msg in (
        (dict(block_t=3), ValueError, "^block_t: expected a power of two"),
        (dict(layout="MODEL1"), ValueError, "^layout: MODEL1 given"),
        (dict(backend="bogus"), ValueError, "^backend"),
    ):
        torch._dynamo.reset()
        with pytest.raises(exc, match=msg):
            torch.compile(lambda *a, kw=kw: quantize_and_store_kv(*a, **kw), fullgraph=True, backend="aot_eager")(
                kv, slots, kc
            )
