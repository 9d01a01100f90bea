"""The benchmarks time what their rows say: ``benchmarks.variants`` validates each index set with
everything the row's call takes (a check that dropped the extra cache and the lengths would let
MODEL1 rows time the main cache alone). CPU, small shapes."""

from __future__ import annotations

import torch

from benchmarks import harness
from benchmarks.variants import problems_of


def test_variant_problems_carry_the_extra_cache_and_the_lengths():
    s = harness.DecodeShape(
        2, 16, 2, 64, 512, ctx=512, pbs=64, extra_topk=32, extra_pbs=16, extra_len=True, topk_len=True
    )
    inp = harness.decode_inputs(s, device="cpu")
    problems = problems_of(inp)
    assert len(problems) == len(inp.index_sets) >= 2
    for i, p in enumerate(problems):
        assert p.extra_k_cache is not None and p.extra_indices is not None
        assert torch.equal(p.indices, inp.index_sets[i]) and torch.equal(p.extra_indices, inp.extra_sets[i])
        assert torch.equal(p.topk_length, inp.topk_length) and torch.equal(p.extra_topk_length, inp.extra_topk_length)


def test_variant_fields_parse_bools_none_and_ints():
    import pytest

    from benchmarks.variants import parse_variant

    for text, want in (("1", True), ("true", True), ("0", False), ("False", False), ("none", None)):
        assert parse_variant(f"v=hopper:half_stages={text}")[2].half_stages is want
    cfg = parse_variant("v=hopper:smem_carveout=-1,pv_regs=152:check")
    assert (cfg[2].smem_carveout, cfg[2].pv_regs, cfg[3]) == (-1, 152, True)
    with pytest.raises(SystemExit, match="is not a bool"):
        parse_variant("v=hopper:half_stages=2")
    with pytest.raises(SystemExit, match="has no field"):
        parse_variant("v=hopper:no_such_field=1")


def test_set_hopper_default(monkeypatch):
    from benchmarks.variants import set_hopper_default
    from sparse_mla.decode.kernels import hopper

    monkeypatch.setattr(hopper, "DEFAULT_CONFIG", hopper.DEFAULT_CONFIG)  # restored after the test
    before = hopper.DEFAULT_CONFIG
    set_hopper_default("")
    assert hopper.DEFAULT_CONFIG is before
    set_hopper_default("half_stages=0,pv_regs=152,smem_carveout=-1")
    cfg = hopper.DEFAULT_CONFIG
    assert (cfg.half_stages, cfg.pv_regs, cfg.smem_carveout) == (False, 152, -1)


def test_dense_rows_count_causal_pairs_and_filter():
    from benchmarks import dense

    assert dense.attended(dense.DenseShape(2, 3, 16, 10, causal=True)) == 8 + 9 + 10
    assert dense.attended(dense.DenseShape(2, 3, 16, 10)) == 30
    assert [s.ctx for s in harness.select(dense.DENSE_SHAPES, "h_q=16")] == [8192]
    assert len(harness.select(dense.DENSE_SHAPES, "b=128;b=4")) == 4
