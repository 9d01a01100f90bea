"""Tile scheduler (``sparse_mla.decode.scheduler``; docs/design.md §5, the walkthrough's step 3)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_mla.decode.scheduler import (
    FIXED_OVERHEAD_NUM_BLOCKS,
    META_FIELDS,
    batch_num_blocks,
    compute_num_sm_parts,
    schedule,
)


def row(begin_req, end_req, begin_block, end_block, begin_split, first, last):
    return dict(
        begin_req=begin_req,
        end_req=end_req,
        begin_block=begin_block,
        end_block=end_block,
        begin_split=begin_split,
        is_first_req_splitted=first,
        is_last_req_splitted=last,
        pad=0,
    )


# ------------------------------------------------------------------ the walkthrough's example


def test_seed_num_sm_parts():
    assert compute_num_sm_parts(132, 1, 128) == 66  # 132 // 1 // ceil(128 / 64)
    assert compute_num_sm_parts(132, 2, 128) == 33
    assert compute_num_sm_parts(132, 1, 64) == 132
    assert compute_num_sm_parts(132, 1, 65) == 66
    assert compute_num_sm_parts(132, 1, 16, heads_per_cta=16) == 132
    assert compute_num_sm_parts(1, 4, 128) == 1  # never below one partition


def test_seed_schedule_table():
    """The walkthrough's step 3 (b=2, topk=128, 132 SMs, h_q=128): 66 partitions of payload 6; four busy ones."""
    main, total = batch_num_blocks(2, 128)
    assert main == [2, 2] and total == [2, 2]
    t = schedule(total, compute_num_sm_parts(132, 1, 128))
    assert t.num_sm_parts == 66
    assert t.payload == 6  # ceil((2 + 5) * 2 / 66) + 5
    assert t.metadata.dtype == torch.int32 and t.metadata.shape == (66, len(META_FIELDS))
    rows = t.rows()
    assert rows[0] == row(0, 0, 0, 1, 0, 0, 1)  # batch 0, block 0; continues later
    assert rows[1] == row(0, 0, 1, 2, 1, 1, 0)  # batch 0, block 1: split 1, started earlier
    assert rows[2] == row(1, 1, 0, 1, 0, 0, 1)
    assert rows[3] == row(1, 1, 1, 2, 1, 1, 0)
    for r in rows[4:]:
        assert r["begin_req"] == 2 and r["begin_req"] > r["end_req"]  # idle: the kernel returns
    assert t.num_splits.tolist() == [0, 2, 4]
    assert t.num_splits.dtype == torch.int32
    assert t.main_blocks.tolist() == [2, 2]


def test_no_split_when_everything_fits():
    t = schedule([3, 1, 2], 1)
    assert t.payload == 3 + 1 + 2 + 15 + 5
    assert t.rows() == [row(0, 2, 0, 2, 0, 0, 0)]
    assert t.num_splits.tolist() == [0, 1, 2, 3]


# ------------------------------------------------------------------ batch_num_blocks


def test_batch_num_blocks_topk_length():
    main, total = batch_num_blocks(6, 200, topk_length=[0, 1, 64, 65, 200, 500])
    assert main == [0, 1, 1, 2, 4, 4]  # ceil(min(len, topk) / 64)
    assert total == [1, 1, 1, 2, 4, 4]  # an empty batch still costs one block (writes lse=+inf)
    main, total = batch_num_blocks(2, 128)
    assert main == [2, 2] and total == [2, 2]
    main, total = batch_num_blocks(1, 1)
    assert main == [1] and total == [1]


def test_batch_num_blocks_extra_cache():
    # extra_topk adds ceil(extra / 64) blocks after the main ones
    main, total = batch_num_blocks(3, 128, extra_topk=100)
    assert main == [2, 2, 2] and total == [4, 4, 4]
    main, total = batch_num_blocks(3, 128, topk_length=[0, 128, 3], extra_topk=100, extra_topk_length=[0, 65, 1])
    assert main == [0, 2, 1]
    assert total == [1, 4, 2]
    main, total = batch_num_blocks(2, 64, topk_length=[0, 10], extra_topk=64, extra_topk_length=[64, 200])
    assert main == [0, 1] and total == [1, 2]


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_sms"):
        compute_num_sm_parts(0, 1, 128)
    with pytest.raises(ValueError, match="s_q"):
        compute_num_sm_parts(132, 0, 128)
    with pytest.raises(ValueError, match="h_q"):
        compute_num_sm_parts(132, 1, True)
    with pytest.raises(ValueError, match="heads_per_cta"):
        compute_num_sm_parts(132, 1, 128, heads_per_cta=0)
    with pytest.raises(ValueError, match="num_sm_parts"):
        schedule([1, 2], 0)
    with pytest.raises(ValueError, match="num_blocks"):
        schedule([1, 0], 4)


# ------------------------------------------------------------------ properties


def check_schedule(num_blocks: list[int], num_sm_parts: int) -> None:
    b = len(num_blocks)
    t = schedule(num_blocks, num_sm_parts)
    ovh = FIXED_OVERHEAD_NUM_BLOCKS
    total = sum(n + ovh for n in num_blocks)
    assert t.payload == -(-total // num_sm_parts) + ovh
    rows = t.rows()
    assert len(rows) == num_sm_parts
    covered: Counter = Counter()
    pieces: dict[int, list[tuple[int, int, int]]] = {i: [] for i in range(b)}  # (split, blk0, blk1)
    seen_idle = False
    for r in rows:
        if r["begin_req"] > r["end_req"]:
            assert r["begin_req"] == b, r  # idle rows say begin_req = b
            seen_idle = True
            continue
        assert not seen_idle, "a busy partition after an idle one"
        assert 0 <= r["begin_req"] <= r["end_req"] < b
        cost = 0
        for req in range(r["begin_req"], r["end_req"] + 1):
            b0 = r["begin_block"] if req == r["begin_req"] else 0
            b1 = r["end_block"] if req == r["end_req"] else num_blocks[req]
            assert 0 <= b0 < b1 <= num_blocks[req], (r, req)
            split = r["begin_split"] if req == r["begin_req"] else 0
            pieces[req].append((split, b0, b1))
            for k in range(b0, b1):
                covered[(req, k)] += 1
            cost += b1 - b0 + ovh
        assert cost <= t.payload, (r, cost, t.payload)
        assert r["is_first_req_splitted"] == int(r["begin_block"] > 0)
        assert r["is_last_req_splitted"] == int(r["end_block"] < num_blocks[r["end_req"]])
        assert r["pad"] == 0
    # every (batch, block) exactly once
    want = {(i, k) for i in range(b) for k in range(num_blocks[i])}
    assert set(covered) == want
    assert all(c == 1 for c in covered.values())
    # splits per batch: 0..n-1 in partition order, contiguous ascending block ranges
    ns = t.num_splits.tolist()
    assert ns[0] == 0 and len(ns) == b + 1
    for i in range(b):
        ps = pieces[i]
        assert [p[0] for p in ps] == list(range(len(ps)))
        assert ps[0][1] == 0 and ps[-1][2] == num_blocks[i]
        assert all(ps[j][2] == ps[j + 1][1] for j in range(len(ps) - 1))
        assert ns[i + 1] - ns[i] == len(ps)
    # the fp32 accumulators hold b + num_sm_parts rows: the split count fits
    assert ns[-1] <= b + num_sm_parts
    assert t.num_blocks == num_blocks


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=12),
    st.integers(1, 80),
)
def test_schedule_properties(num_blocks, num_sm_parts):
    check_schedule(num_blocks, num_sm_parts)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6),  # b
    st.integers(1, 600),  # topk
    st.data(),
    st.sampled_from([1, 2, 7, 33, 66, 132]),
)
def test_schedule_properties_from_topk_lengths(b, topk, data, num_sm_parts):
    lengths = data.draw(st.lists(st.integers(0, topk), min_size=b, max_size=b))
    extra = data.draw(st.sampled_from([0, 64, 100]))
    elen = data.draw(st.lists(st.integers(0, extra), min_size=b, max_size=b)) if extra else None
    main, total = batch_num_blocks(b, topk, lengths, extra, elen)
    for i in range(b):
        assert main[i] == -(-lengths[i] // 64)
        e = elen[i] if elen is not None else 0
        assert total[i] == max(main[i] + -(-e // 64), 1)
    check_schedule(total, num_sm_parts)
    t = schedule(total, num_sm_parts, main_blocks=main)
    assert t.main_blocks.tolist() == main


def test_schedule_many_small_batches_share_partitions():
    t = schedule([1] * 10, 4)
    busy = [r for r in t.rows() if r["begin_req"] <= r["end_req"]]
    assert any(r["end_req"] > r["begin_req"] for r in busy)  # one partition serves several batches
    assert t.num_splits.tolist() == list(range(11))  # 1-block batches never split here
    check_schedule([1] * 10, 4)


def test_schedule_single_long_batch_splits_over_all_parts():
    t = schedule([32], 8)
    # payload ceil(37/8) + 5 = 10: 5 blocks per partition
    assert t.payload == 10
    rows = t.rows()
    assert [(r["begin_block"], r["end_block"]) for r in rows[:7]] == [(5 * i, min(5 * i + 5, 32)) for i in range(7)]
    assert t.num_splits.tolist() == [0, 7]
    assert rows[7]["begin_req"] == 1
