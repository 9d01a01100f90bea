"""Schedules made on the device from ``topk_length`` / ``extra_topk_length``: the PyTorch twin's
partition, the Triton kernel against it, and a scheduler object reused while the lengths change
(eagerly, through the custom op, and in CUDA-graph replays) against a float64 oracle."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from helpers import make_problem, oracle64
from hypothesis import given, settings
from hypothesis import strategies as st

import sparse_mla as flash_mla
from sparse_mla.decode.op import schedule_tensors
from sparse_mla.decode.scheduler import (
    FIXED_OVERHEAD_NUM_BLOCKS,
    dynamic_acc_rows,
    length_block_counts,
    schedule_from_lengths,
)

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
KERNELS = ON_GPU or os.environ.get("TRITON_INTERPRET", "0") == "1"
needs_kernels = pytest.mark.skipif(not KERNELS, reason="kernels need a GPU or TRITON_INTERPRET=1")
OVH = FIXED_OVERHEAD_NUM_BLOCKS


def check_partition(t, num_blocks: list[int], parts: int) -> None:
    """Every (batch, block) in exactly one partition, pieces numbered in order, each partition's
    work within ``ceil(T / parts) + 5`` blocks, the prefix sums and the accumulator bound."""
    b = len(num_blocks)
    cap = -(-sum(n + OVH for n in num_blocks) // parts)
    covered: Counter = Counter()
    pieces: dict[int, list[int]] = {i: [] for i in range(b)}
    for r in t.rows():
        if r["begin_req"] > r["end_req"]:
            assert (r["begin_req"], r["end_req"]) == (b, b - 1), r
            continue
        cost = 0
        for req in range(r["begin_req"], r["end_req"] + 1):
            b0 = r["begin_block"] if req == r["begin_req"] else 0
            b1 = r["end_block"] if req == r["end_req"] else num_blocks[req]
            assert 0 <= b0 < b1 <= num_blocks[req], (r, req)
            pieces[req].append(r["begin_split"] if req == r["begin_req"] else 0)
            covered.update((req, k) for k in range(b0, b1))
            cost += b1 - b0 + OVH
        assert cost <= cap + OVH, (r, cost, cap)
        assert r["is_first_req_splitted"] == int(r["begin_block"] > 0)
        assert r["is_last_req_splitted"] == int(r["end_block"] < num_blocks[r["end_req"]])
    assert set(covered) == {(i, k) for i in range(b) for k in range(num_blocks[i])}
    assert set(covered.values()) == {1}
    ns, acc = t.num_splits.tolist(), t.acc_rows.tolist()
    assert ns[0] == acc[0] == 0
    for i in range(b):
        assert pieces[i] == list(range(len(pieces[i])))
        assert ns[i + 1] - ns[i] == len(pieces[i])
        assert acc[i + 1] - acc[i] == (len(pieces[i]) if len(pieces[i]) > 1 else 0)
    assert acc[-1] <= t.num_acc_rows == dynamic_acc_rows(b, parts)
    assert t.num_blocks_t.tolist() == num_blocks and t.dynamic
    # the combine's list: the split batches in order, at most one per partition boundary
    split = [i for i in range(b) if len(pieces[i]) > 1]
    assert len(split) <= parts - 1 and t.split_list.shape == (parts + 1,)
    assert split_batches(t) == split


def split_batches(t) -> list[int]:
    """The batches a table's ``split_list`` names (its count, then that many entries)."""
    lst = t.split_list.cpu().tolist()
    return lst[1 : 1 + lst[0]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=16), st.integers(1, 140))
def test_twin_partition(num_blocks, parts):
    nb = torch.tensor(num_blocks)
    check_partition(schedule_from_lengths(nb, nb, parts), num_blocks, parts)


def test_twin_block_counts():
    tl = torch.tensor([0, 1, 64, 65, 500, -3], dtype=torch.int32)
    etl = torch.tensor([0, 0, 10, 200, 1, 0], dtype=torch.int32)
    main, total = length_block_counts(6, 300, tl, 128, etl)
    assert main.tolist() == [0, 1, 1, 2, 5, 0]  # clamped to [0, topk]
    assert total.tolist() == [1, 1, 2, 4, 6, 1]  # extra clamped to 128; an empty batch still has one block
    main, total = length_block_counts(3, 130, None, 0, None, device="cpu")
    assert main.tolist() == total.tolist() == [3, 3, 3]


def _random_lengths(g, b, cap, p_none):
    if torch.rand(1, generator=g).item() < p_none:
        return None
    return torch.randint(-2, cap + 3, (b,), generator=g, dtype=torch.int32)


@needs_kernels
@pytest.mark.parametrize("chunk", [None, 16])
def test_kernel_matches_twin(monkeypatch, chunk):
    from sparse_mla.decode.backends import dynamic_table
    from sparse_mla.decode.kernels import schedule as kernel

    if chunk is not None:  # several chunks of batches per program
        monkeypatch.setattr(kernel, "MAX_CHUNK", chunk)
    g = torch.Generator().manual_seed(7)
    # (one program per partition, each interpreted: a few cases, few partitions but one full-size)
    part_counts = [1, 2, 5, 9, 132] if chunk is None else [3, 4, 7]
    for parts in part_counts:
        b = int(torch.randint(1, 60 if chunk is None else 50, (1,), generator=g))
        topk = [1, 64, 100, 2048][int(torch.randint(0, 4, (1,), generator=g))]
        extra = [0, 64, 130][int(torch.randint(0, 3, (1,), generator=g))]
        tl = _random_lengths(g, b, topk, 0.2)
        etl = _random_lengths(g, b, extra, 0.3) if extra else None
        main, total = length_block_counts(b, topk, tl, extra, etl, device="cpu")
        want = schedule_from_lengths(main, total, parts)
        into = dynamic_table(b, parts, torch.device(DEVICE))
        for t in (into.metadata, into.num_splits, into.acc_rows, into.main_blocks, into.num_blocks_t, into.split_list):
            t.fill_(-7)  # every element is written (the list: its count and that many entries)
        got = kernel.schedule_fwd(
            None if tl is None else tl.to(DEVICE), None if etl is None else etl.to(DEVICE), topk, extra, into
        )
        for name in ("metadata", "num_splits", "acc_rows", "main_blocks", "num_blocks_t"):
            assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), (name, b, parts, topk, extra)
        assert split_batches(got) == split_batches(want), (b, parts, topk, extra)


@pytest.mark.parametrize(
    ("b", "parts", "whole"), [(64, 33, True), (128, 66, True), (6, 3, True), (2, 33, False), (1, 5, False)]
)
def test_equal_lengths_take_the_host_partition(b, parts, whole):
    """Batches of one length are not split where a whole number of them fits the host scheduler's
    payload: the same partition as the host's, no accumulator rows (each split cost a combine)."""
    from sparse_mla.decode.backends import dynamic_table
    from sparse_mla.decode.kernels import schedule as kernel
    from sparse_mla.decode.scheduler import schedule

    tl = torch.full((b,), 2048, dtype=torch.int32)
    main, total = length_block_counts(b, 2048, tl)
    got = schedule_from_lengths(main, total, parts)
    check_partition(got, total.tolist(), parts)
    host = schedule(total.tolist(), parts, main_blocks=main.tolist())
    assert torch.equal(got.metadata, host.metadata) == whole
    assert (int(got.acc_rows[-1]) == 0) == whole
    if KERNELS:
        into = dynamic_table(b, parts, torch.device(DEVICE))
        made = kernel.schedule_fwd(tl.to(DEVICE), None, 2048, 0, into)
        for name in ("metadata", "num_splits", "acc_rows", "main_blocks", "num_blocks_t"):
            assert torch.equal(getattr(made, name).cpu(), getattr(got, name)), name
        assert split_batches(made) == split_batches(got)


# ---------------------------------------------------------------- reuse while the lengths change


def _lengths_problem(lengths, extra_lengths=None, seed=0, **kw):
    base = dict(b=3, s_q=1, h_q=16, topk=192, num_blocks=6, invalid_frac=0.0, topk_length=lengths)
    if extra_lengths is not None:
        base.update(extra_topk=64, extra_topk_length=extra_lengths)
    return make_problem(seed=seed, **{**base, **kw}).to(DEVICE)


def _close_to_oracle(p, out, lse):
    want_out, want_lse = oracle64(p)
    assert (out.double().cpu() - want_out).abs().max() < 2e-2
    lse = lse.double().cpu()
    fin = torch.isfinite(want_lse)
    assert torch.equal(torch.isposinf(lse), torch.isposinf(want_lse))
    if fin.any():  # (every length 0: every lse is +inf, compared above)
        assert (lse[fin] - want_lse[fin]).abs().max() < 1e-3


LENGTH_STEPS = [([10, 192, 0], None), ([192, 192, 192], None), ([1, 130, 65], None)]
EXTRA_STEPS = [([10, 192, 0], [64, 0, 3]), ([0, 5, 192], [64, 64, 64]), ([192, 0, 1], [0, 1, 0])]


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("steps", [LENGTH_STEPS, EXTRA_STEPS], ids=["topk_length", "extra_topk_length"])
def test_reused_scheduler_follows_the_lengths(backend, steps):
    if backend == "auto" and not KERNELS:
        pytest.skip("kernels need a GPU or TRITON_INTERPRET=1")
    meta, _ = flash_mla.get_mla_metadata(num_sms=8)  # several partitions: batches are split
    for lengths, extra in steps:  # one object, the same shapes, other lengths each call
        p = _lengths_problem(lengths, extra)
        out, lse = flash_mla.flash_mla_with_kvcache(
            p.q, p.k_cache, None, None, 512, meta, is_fp8_kvcache=True, backend=backend, **p.api_kwargs()
        )
        _close_to_oracle(p, out, lse)
    assert meta.table.dynamic


@needs_kernels
def test_op_makes_the_schedule_of_its_lengths():
    meta, _ = flash_mla.get_mla_metadata(num_sms=8)
    p0 = _lengths_problem([192, 192, 192])
    flash_mla.flash_mla_with_kvcache(p0.q, p0.k_cache, None, None, 512, meta, is_fp8_kvcache=True, **p0.api_kwargs())
    stale = schedule_tensors(meta)  # tensors of the object, as a caller of the op would pass them
    p = _lengths_problem([7, 0, 150], seed=1)
    out, lse = torch.ops.sparse_mla.sparse_decode(
        p.q, p.k_cache, p.indices, **stale, sm_scale=p.q.shape[-1] ** -0.5, topk_length=p.topk_length
    )
    _close_to_oracle(p, out, lse)


@pytest.mark.gpu
def test_graph_replay_follows_the_lengths():
    import gc

    meta, _ = flash_mla.get_mla_metadata()
    p = _lengths_problem([192, 192, 192], b=3)
    lengths = p.topk_length
    kw = dict(is_fp8_kvcache=True, **p.api_kwargs())
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        flash_mla.flash_mla_with_kvcache(p.q, p.k_cache, None, None, 512, meta, **kw)  # fills the object
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flash_mla.flash_mla_with_kvcache(p.q, p.k_cache, None, None, 512, meta, **kw)
    del meta  # the graph does not depend on the object
    gc.collect()
    torch.cuda.empty_cache()
    for new in ([192, 192, 192], [3, 190, 0], [64, 1, 129], [0, 0, 0]):
        lengths.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        _close_to_oracle(p, out, lse)
