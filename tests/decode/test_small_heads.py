"""The portable decode at small head counts (tensor-parallel slices, 1 <= h_q <= 32,
any value) vs the fp32 reference (:func:`sparse_mla.decode.reference.sparse_decode_reference`).

The portable kernel runs 16-head programs for h_q <= 16 and 64-head ones above (heads on the dots'
M; a heads-on-N variant measured slower on the H200, docs/perf-log.md), so head counts that are
not a multiple of the tile leave padded head rows in every program: these tests cover every tile
boundary (1, 3, 8, 13, 16 | 17, 24, 31, 32), both cache layouts, the optional inputs, invalid indices, NaN in unused
cache slots, odd page sizes, and an unsplit (one partition) and a split (combine) schedule for
each. Inputs are fresh random data, seeded from the case's name. Under the interpreter on a CPU
the shapes are small (topk <= 160, b <= 3).
"""

from __future__ import annotations

import dataclasses
import os
import zlib

import pytest
import torch
from cache_bytes import poison_unattended
from helpers import ON_HOPPER, check_decode_close, make_problem

import sparse_mla as flash_mla
from sparse_mla.decode import BACKENDS
from sparse_mla.decode.kernels import portable as portable_mod
from sparse_mla.decode.reference import LOG2E, gather_kv, sparse_decode_reference
from sparse_mla.decode.scheduler import compute_num_sm_parts
from sparse_mla.testing import FLASHMLA_DECODE

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
KERNELS = ON_GPU or os.environ.get("TRITON_INTERPRET", "0") == "1"
needs_kernels = pytest.mark.skipif(
    not KERNELS, reason="kernels need a GPU or TRITON_INTERPRET=1 (set before starting pytest)"
)

INF = float("inf")
# on an sm_90 GPU the Hopper kernel's narrow consumer (16/32-head tiles) runs the same cases
BACKENDS_UNDER_TEST = ["portable"] + (["hopper"] if ON_HOPPER else [])


def _seed(name: str) -> int:
    return zlib.crc32(name.encode()) % 10_000


def _sink(h_q: int, seed: int, with_inf: bool) -> list[float]:
    """Per-head sinks around the lse values (random, O(1)); ``with_inf``: head 0 gets +inf (its
    output must be 0) and head 1 -inf (no effect), when there are heads to spare."""
    g = torch.Generator().manual_seed(seed + 77)
    s = (torch.randn(h_q, generator=g) * 2 + 1).tolist()
    if with_inf and h_q >= 3:
        s[0], s[1] = INF, -INF
    return s


def _poke_invalid(p) -> None:
    """Put the edge values of invalid indices at fixed places: -1, exactly num_tokens (the first
    slot past the cache), num_tokens + 7 and INT32_MAX (on top of make_problem's random ones)."""
    nb, pbs = p.k_cache.shape[:2]
    n_tok = nb * pbs
    b = p.indices.shape[0]
    p.indices[0, 0, 1] = -1
    p.indices[0, -1, 2] = n_tok
    p.indices[b - 1, 0, 3] = n_tok + 7
    p.indices[b - 1, -1, 5] = 2**31 - 1


def _tile(h_q: int, backend: str = "portable") -> int:
    return BACKENDS[backend].heads_per_cta(h_q)


def _schedules(s_q: int, h_q: int, backend: str = "portable") -> dict[str, int]:
    """``num_sms`` of an unsplit schedule (one partition: every batch in one piece, no combine) and
    of a split one (a partition per few blocks: batches in several pieces, combine kernel)."""
    return {"unsplit": s_q * -(-h_q // _tile(h_q, backend)), "split": 132}


def run_backend(p, num_sms, backend="portable"):
    meta, _ = flash_mla.get_mla_metadata(num_sms=num_sms)
    out, lse = flash_mla.flash_mla_with_kvcache(
        p.q, p.k_cache, None, None, 512, meta, is_fp8_kvcache=True, backend=backend, **p.api_kwargs()
    )
    assert meta.backend == backend
    return out, lse, meta.table


def reference(p):
    return sparse_decode_reference(p.q, p.k_cache, p.indices, None, 512, **p.ref_kwargs())


def check_both_schedules(p, tol=FLASHMLA_DECODE) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run each backend under test under the unsplit and the split schedule; each must match the
    reference (FlashMLA's tolerances unless ``tol``) and the schedule must be the intended one."""
    b, s_q, h_q, _ = p.q.shape
    ro, rl = reference(p)
    results = []
    for backend, (sched, num_sms) in (
        (be, item) for be in BACKENDS_UNDER_TEST for item in _schedules(s_q, h_q, be).items()
    ):
        out, lse, table = run_backend(p, num_sms, backend)
        assert out.shape == (b, s_q, h_q, 512) and lse.shape == (b, h_q, s_q)
        assert table.any_split == (sched == "split"), f"{sched}: any_split = {table.any_split}"
        try:
            check_decode_close(out, lse, ro, rl, tol=tol)
        except AssertionError as e:
            raise AssertionError(f"{backend}, {sched} schedule (num_sms={num_sms}): {e}") from None
        results.append((out, lse))
    return results


# (name, h_q, layout, s_q, b, topk, page_block_size, topk_length, extra_topk, extra_topk_length, sink)
# Every h_q runs in both layouts; topk is never a multiple of 64 or a batch's topk_length cuts a
# block, so each case has a partial last block; at least one batch has > 64 keys so that the split
# schedule splits it. Extra caches (3 blocks of 32 tokens) in V32 and MODEL1 rows alike.
CASES = [
    ("h1-v32", 1, "V32", 1, 2, 96, 64, None, 0, None, False),
    ("h1-m1-extra-len", 1, "MODEL1", 3, 2, 100, 64, [0, 100], 70, [70, 0], True),
    ("h3-v32-len-sink", 3, "V32", 2, 3, 130, 64, [0, 70, 130], 0, None, True),
    ("h3-m1-pbs61", 3, "MODEL1", 1, 2, 100, 61, None, 0, None, False),
    ("h8-v32-pbs2", 8, "V32", 3, 2, 96, 2, [96, 33], 0, None, False),
    ("h8-m1-extra-len-sink", 8, "MODEL1", 2, 3, 128, 64, [128, 0, 65], 96, [5, 96, 0], True),
    ("h13-v32-len-sink", 13, "V32", 1, 3, 150, 64, [1, 150, 200], 0, None, True),
    ("h13-m1-pbs61-extra", 13, "MODEL1", 3, 2, 96, 61, None, 64, None, False),
    ("h16-v32-extra-len", 16, "V32", 2, 2, 160, 64, [160, 64], 40, [40, 17], False),
    ("h16-m1-len-sink", 16, "MODEL1", 1, 3, 130, 64, [130, 0, 129], 0, None, True),
    ("h17-v32-pbs61-len", 17, "V32", 3, 2, 100, 61, [99, 1], 0, None, False),
    ("h17-m1-extra-sink", 17, "MODEL1", 2, 2, 96, 64, None, 80, None, True),
    ("h24-v32-pbs2-sink", 24, "V32", 1, 3, 96, 2, None, 0, None, True),
    ("h24-m1-len-extra", 24, "MODEL1", 3, 2, 150, 64, [150, 0], 64, [64, 64], False),
    ("h31-v32-len-sink-extra", 31, "V32", 2, 3, 140, 64, [140, 65, 0], 50, [0, 50, 25], True),
    ("h31-m1-pbs2", 31, "MODEL1", 1, 2, 100, 2, None, 0, None, False),
    ("h32-v32-len-sink", 32, "V32", 3, 2, 128, 64, [127, 128], 0, None, True),
    ("h32-m1-pbs61-extra-len-sink", 32, "MODEL1", 2, 3, 96, 61, [96, 70, 0], 90, [90, 0, 31], True),
]


def _problem(name, h_q, layout, s_q, b, topk, pbs, lens, extra, extra_lens, sink, invalid_frac=0.1):
    seed = _seed(name)
    p = make_problem(
        b=b,
        s_q=s_q,
        h_q=h_q,
        topk=topk,
        layout=layout,
        num_blocks=max(2 * topk // pbs + 2, 3),
        page_block_size=pbs,
        seed=seed,
        invalid_frac=invalid_frac,
        topk_length=lens,
        extra_topk=extra,
        extra_topk_length=extra_lens,
        attn_sink=_sink(h_q, seed, with_inf=True) if sink else None,
    )
    _poke_invalid(p)
    return p.to(DEVICE)


@needs_kernels
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(case):
    p = _problem(*case)
    assert (p.q.float() != 0).all() and (p.k.float() != 0).all()  # fresh random data, never zeros
    for out, _ in check_both_schedules(p):
        if p.attn_sink is not None and p.q.shape[2] >= 3:
            assert (out[:, :, 0].float() == 0).all()  # +inf sink zeroes head 0
            assert (out[:, :, 1].float() != 0).any()


@needs_kernels
@pytest.mark.parametrize(
    "h_q, layout, s_q, pbs, extra",
    [(13, "V32", 2, 64, 70), (24, "MODEL1", 1, 61, 80), (3, "V32", 3, 2, 0)],
    ids=["h13-v32-extra", "h24-m1-pbs61-extra", "h3-v32-pbs2"],
)
def test_nan_in_unattended_slots_never_leaks(h_q, layout, s_q, pbs, extra):
    # slots past topk_length, behind invalid indices and never indexed hold NaN bytes and NaN
    # scales; block padding (MODEL1) too; nothing of them may reach out or lse
    b, topk = 3, 130
    p = _problem(
        f"nan-{h_q}-{layout}",
        h_q,
        layout,
        s_q,
        b,
        topk,
        pbs,
        [130, 70, 0],
        extra,
        [extra, 0, 9] if extra else None,
        True,
        0.3,
    )
    n_tok = p.k_cache.shape[0] * p.k_cache.shape[1]
    kept = poison_unattended(p.k_cache, p.indices, p.topk_length)
    assert 0 < kept < n_tok
    if extra:
        kept = poison_unattended(p.extra_k_cache, p.extra_indices, p.extra_topk_length)
        assert 0 < kept < p.extra_k_cache.shape[0] * p.extra_k_cache.shape[1]
    for out, lse in check_both_schedules(p):
        assert torch.isfinite(out.float()).all() and not torch.isnan(lse).any()


@needs_kernels
@pytest.mark.parametrize("h_q, layout", [(5, "V32"), (17, "MODEL1"), (32, "V32")])
def test_lonely_queries(h_q, layout):
    # no valid key: out 0 and lse +inf whatever the sink (topk_length 0 with extra_topk_length 0,
    # every index -1, every index out of range, only invalid indices below topk_length)
    name = f"lonely-{h_q}-{layout}"
    p = _problem(name, h_q, layout, 2, 4, 100, 64, [0, 100, 100, 3], 40, [0, 0, 0, 0], True)
    n_tok = p.k_cache.shape[0] * p.k_cache.shape[1]
    p.indices[1, 0] = -1
    p.indices[1, 1] = n_tok
    p.indices[2] = 2**31 - 1
    p.indices[3, :, :3] = -1
    for out, lse in check_both_schedules(p):
        assert torch.isposinf(lse).all() and (out.float() == 0).all()


# ------------------------------------------------------------------------------ the schedule


def test_head_tiles():
    """Portable: programs of 16 heads for h_q <= 16, FlashMLA's 64 above. Hopper: 16 / 32 / 64
    (its narrow consumer puts 16 or 32 heads on the wgmma's N)."""
    for h_q in range(1, 129):
        assert _tile(h_q) == (16 if h_q <= 16 else 64), h_q
        assert BACKENDS["hopper"].heads_per_cta(h_q) == (16 if h_q <= 16 else 32 if h_q <= 32 else 64), h_q


@needs_kernels
@pytest.mark.parametrize("h_q", [1, 16, 17, 32, 33])
def test_portable_launch_uses_the_tile(h_q, monkeypatch):
    # the schedule is sized for the declared tile, and the kernel is launched with that tile:
    # ceil(h_q / tile) programs per partition and query token
    launches = []
    real = portable_mod.launch_fitting

    def spy(kernel, grid, args, consts, *rest, **kw):
        launches.append((grid, consts))
        return real(kernel, grid, args, consts, *rest, **kw)

    monkeypatch.setattr(portable_mod, "launch_fitting", spy)
    s_q, num_sms = 2, 24
    p = _problem(f"tile-{h_q}", h_q, "V32", s_q, 2, 96, 64, None, 0, None, False)
    out, lse, table = run_backend(p, num_sms)
    tile = 16 if h_q <= 16 else 64
    assert table.num_sm_parts == compute_num_sm_parts(num_sms, s_q, h_q, tile)
    assert len(launches) == 1
    grid, consts = launches[0]
    assert tuple(grid) == (table.num_sm_parts, s_q, -(-h_q // tile))
    assert consts["BLOCK_H"] == tile
    check_decode_close(out, lse, *reference(p))


@needs_kernels
@pytest.mark.parametrize("h_q, layout, s_q", [(1, "V32", 2), (13, "MODEL1", 1), (32, "V32", 3)])
def test_rising_scores_rescale_the_running_sum(h_q, layout, s_q):
    # each query's keys sorted by rising score, with queries that make the scores spread widely
    # (heads share most of their direction): every block raises the running max of every head by
    # more than the kernel's lazy-rescale threshold, so acc and l are rescaled at each step
    name = f"rising-{h_q}-{layout}"
    p = _problem(name, h_q, layout, s_q, 2, 150, 64, None, 0, None, False)
    g = torch.Generator().manual_seed(_seed(name))
    shared = torch.randn(1, s_q, 1, p.q.shape[-1], generator=g)
    q = (shared * 48 + torch.randn(p.q.shape, generator=g)).to(torch.bfloat16)
    k, valid = gather_kv(p.k_cache.cpu(), p.indices.cpu())
    # per-head scores in the kernel's units (log2, scaled by d_qk^-0.5)
    s = torch.einsum("bshd,bstd->bsht", q.float(), k) * (q.shape[-1] ** -0.5 * LOG2E)
    s = s.masked_fill(~valid.unsqueeze(2), -INF)
    order = s.mean(dim=2).argsort(dim=-1)  # invalid ones first
    p.indices = torch.gather(p.indices.cpu(), -1, order).to(DEVICE)
    p.q = q.to(DEVICE)
    s = torch.gather(s, -1, order.unsqueeze(2).expand_as(s))
    blk_max = s[..., :128].unflatten(-1, (2, 64)).amax(-1)  # [b, s_q, h_q, 2]: blocks 0 and 1
    assert (blk_max[..., 1] - blk_max[..., 0] > 8).all()  # every head's max jumps by > 2^8
    # Scores reach 670 (log2 units): a few keys carry each row and their V values cancel, so the
    # bf16 rounding of P shows as absolute error. The compiled portable kernel missed FlashMLA's
    # out_abs = 1e-3 by 3e-4 on 1 of 98304 entries here (H200, h_q 32, s_q 3); a rescale bug is
    # off by O(1), so the check keeps FlashMLA's bounds with out_abs = 2e-3.
    check_both_schedules(p, tol=dataclasses.replace(FLASHMLA_DECODE, out_abs=2e-3))
