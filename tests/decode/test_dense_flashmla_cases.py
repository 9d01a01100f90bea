"""FlashMLA 1.0's dense decode test cases (``tests/test_flash_mla_dense_decoding.py`` in its
repository), run against our PyTorch twin with FlashMLA's data and tolerances. GPU only: the
contexts reach 32K tokens at 128 requests.

FlashMLA's data: q and the cache ``randn / 10`` clamped to [-1, 1]; a shuffled block table of
256-token-padded rows whose entries past a request's length hold 2147480000; NaN in every cache
slot past a request's length; varlen lengths ``max(N(s_k, s_k / 2), s_q)``; in the corner cases
about half the requests have length 0. Its matrix: b 1/2/6/64, s_q 1/2/4, s_k 20/140/4096,
h_q 1/3/9/63/64/126/128, h_kv 1/2/3/8, varlen and causal on/off, bf16 and fp16; plus 128 requests
of 4096 (some of length 0) and its performance shapes (128 requests, s_q 1/2, 4K-32K). Of its
2016-case matrix a sample of 84 runs by default (every value of every axis, every b × s_k × h_q);
``--all-flashmla-cases`` runs all of them (about 6 minutes with 15 workers on an H100). The cache
format has one latent head (``h_kv = 1``): the cases with ``h_kv > 1`` are refused with a
``ValueError`` naming ``k_cache`` (one test says so) and run here with ``h_kv = 1``.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import GARBAGE_BLOCK

import sparse_mla as flash_mla
from sparse_mla.decode.reference import dense_decode_reference
from sparse_mla.testing import FLASHMLA_DENSE_DECODE as DENSE
from sparse_mla.testing import check_decode_close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashMLA's dense cases need a GPU (contexts to 32K)"),
]


ALL_CASES = [
    (b, s_q, s_k, h_q, varlen, causal, dtype)
    for b in (1, 2, 6, 64)
    for s_q in (1, 2, 4)
    for s_k in (20, 140, 4096)
    for h_q in (1, 3, 9, 63, 64, 126, 128)
    for varlen in (False, True)
    for causal in (False, True)
    for dtype in (torch.bfloat16, torch.float16)
]
#: one case per (b, s_k, h_q), s_q / varlen / causal / dtype cycled through: every value of every
#: axis and every pair of b, s_k and h_q, in 84 of the 2016 (``--all-flashmla-cases`` runs them all)
SAMPLED_CASES = [
    (b, (1, 2, 4)[i % 3], s_k, h_q, bool(i % 2), bool(i // 2 % 2), (torch.bfloat16, torch.float16)[i // 4 % 2])
    for i, (b, s_k, h_q) in enumerate(
        (b, s_k, h_q) for b in (1, 2, 6, 64) for s_k in (20, 140, 4096) for h_q in (1, 3, 9, 63, 64, 126, 128)
    )
]
CORNER = [(128, 2, 4096, h_q, True, causal) for h_q in (1, 3, 9, 63, 64, 126, 128) for causal in (False, True)]
PERFORMANCE = [(128, s_q, s_k, 128, True, causal) for causal in (False, True) for s_q in (1, 2) for s_k in (4096, 8192, 16384, 32768)]  # fmt: skip


def flashmla_data(b, s_q, s_k, h_q, varlen, causal, zero_lengths=False, dtype=torch.bfloat16, seed=0, pbs=64):
    """(q, k_cache, block_table, cache_seqlens) as FlashMLA's dense test builds them."""
    random.seed(seed)
    torch.manual_seed(seed)
    lens = torch.full((b,), s_k, dtype=torch.int32)
    if varlen:
        for i in range(b):
            lens[i] = max(random.normalvariate(s_k, s_k / 2), s_q)
    if zero_lengths:
        lens[torch.randn(b) > 0] = 0
    padded = -(-int(lens.max()) // 256) * 256
    nblk = padded // pbs
    table = torch.randperm(b * nblk, dtype=torch.int32).view(b, nblk)
    q = (torch.randn(b, s_q, h_q, 576, device="cuda") / 10).clamp_(-1, 1).to(dtype)
    k = (torch.randn(b * nblk, pbs, 1, 576, device="cuda") / 10).clamp_(-1, 1).to(dtype)
    for i in range(b):
        n = int(lens[i])
        used = -(-n // pbs)
        k[table[i, used:].long().cuda()] = float("nan")
        if n % pbs:
            k[int(table[i, used - 1]), n % pbs :] = float("nan")
        table[i, used:] = GARBAGE_BLOCK
    return q, k, table.cuda(), lens.cuda()


def run_case(b, s_q, s_k, h_q, varlen, causal, zero_lengths=False, dtype=torch.bfloat16):
    q, k, table, lens = flashmla_data(b, s_q, s_k, h_q, varlen, causal, zero_lengths, dtype)
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(q, k, table, lens, 512, meta, causal=causal)
    # the twin one request at a time (its [b, max_blocks * 64, 576] float32 keys would not fit)
    refs = [dense_decode_reference(q[i : i + 1], k, table[i : i + 1], lens[i : i + 1], causal=causal) for i in range(b)]
    ref_out = torch.cat([r[0] for r in refs])
    ref_lse = torch.cat([r[1] for r in refs])
    check_decode_close(out, lse, ref_out, ref_lse, tol=DENSE)


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ == "test_correctness_cases":
        cases = ALL_CASES if metafunc.config.getoption("--all-flashmla-cases") else SAMPLED_CASES
        ids = ["-".join(str(v) for v in c[:6]) + ("-bf16" if c[6] is torch.bfloat16 else "-fp16") for c in cases]
        metafunc.parametrize("b, s_q, s_k, h_q, varlen, causal, dtype", cases, ids=ids)


def test_correctness_cases(b, s_q, s_k, h_q, varlen, causal, dtype):
    run_case(b, s_q, s_k, h_q, varlen, causal, dtype=dtype)


@pytest.mark.parametrize("b, s_q, s_k, h_q, varlen, causal", CORNER)
def test_zero_length_corner_cases(b, s_q, s_k, h_q, varlen, causal):
    run_case(b, s_q, s_k, h_q, varlen, causal, zero_lengths=True)


@pytest.mark.parametrize("b, s_q, s_k, h_q, varlen, causal", PERFORMANCE)
def test_performance_shapes(b, s_q, s_k, h_q, varlen, causal):
    run_case(b, s_q, s_k, h_q, varlen, causal)


def test_more_than_one_kv_head_is_refused():
    q, k, table, lens = flashmla_data(2, 1, 140, 8, False, False)
    k2 = k.expand(-1, -1, 2, -1)
    meta, _ = flash_mla.get_mla_metadata()
    with pytest.raises(ValueError, match="^k_cache: "):
        flash_mla.flash_mla_with_kvcache(q, k2, table, lens, 512, meta)
