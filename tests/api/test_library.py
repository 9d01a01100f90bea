"""``torch.library`` ops of ``sparse_mla.library``: opcheck, agreement with the functions they wrap,
and a ``torch.compile(fullgraph=True)`` smoke test of a whole serving step.

On the CPU the ops run the Triton kernels in the interpreter (``TRITON_INTERPRET=1``). Caches are
``uint8`` here: torch's schema checker (part of opcheck) compares mutated/input tensors with
``allclose``, which is not implemented for ``float8_e4m3fn`` on the CPU.
"""

from __future__ import annotations

import os

import pytest
import torch
from cache_bytes import expected_after_store, storage_bytes, to_device
from helpers import check_decode_close, make_problem

import sparse_mla as flash_mla
import sparse_mla.library as lib
from sparse_mla import abs_indices_to_kvcache_indices, get_layout
from sparse_mla.decode.op import bound_schedule_tensors
from sparse_mla.reference import combine_reference, sparse_decode_reference

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1",
    reason="kernels need a GPU or TRITON_INTERPRET=1 (set before starting pytest)",
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
OPCHECK_OK = {"test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"}


def to_dev(p):
    return p.to(DEV)


def assert_opcheck(op, args, kwargs=None):
    res = torch.library.opcheck(op, args, kwargs or {})
    assert set(res) == OPCHECK_OK and all(v == "SUCCESS" for v in res.values()), res


def test_ops_are_registered():
    for name in lib.OPS:
        ns, op = name.split("::")
        assert hasattr(getattr(torch.ops, ns), op), name

    # the mutated arguments are declared (alias annotations "Tensor(aN!)"), nothing else is
    def mutated(op):
        return [a.name for a in op.default._schema.arguments if a.alias_info is not None and a.alias_info.is_write]

    assert mutated(torch.ops.sparse_mla.quantize_and_store_kv) == ["k_cache"]
    assert mutated(torch.ops.sparse_mla.combine) == ["out", "lse"]
    assert mutated(torch.ops.sparse_mla.sparse_decode) == []
    assert mutated(torch.ops.sparse_mla.abs_indices_to_kvcache_indices) == []
    assert mutated(torch.ops.sparse_mla.sparse_prefill) == []


@pytest.mark.parametrize("layout,num_sms,extras", [("V32", 32, False), ("MODEL1", 4, True)])
def test_sparse_decode_op(layout, num_sms, extras):
    kw = dict(topk_length=[7, 128], attn_sink=[0.5, -1.0], extra_topk=40, extra_topk_length=[40, 3]) if extras else {}
    p = to_dev(make_problem(b=2, h_q=16, topk=128, layout=layout, num_blocks=3, seed=5, out_dtype=torch.uint8, **kw))
    meta, _ = flash_mla.get_mla_metadata(num_sms=num_sms)
    out, lse = lib.sparse_decode(
        p.q, p.k_cache, p.indices, meta, **{k: v for k, v in p.api_kwargs().items() if k != "indices"}
    )
    ro, rl = sparse_decode_reference(p.q, p.k_cache, p.indices, None, 512, **p.ref_kwargs())
    check_decode_close(out, lse, ro, rl)
    st = lib.schedule_tensors(meta)
    # many partitions for 2 batches: split, combine runs; with lengths the schedule is made per call
    # on the device, and the accumulators are sized for the most it can split
    assert st["any_split"] == (num_sms == 32 or extras)
    kwargs = dict(
        **st,
        sm_scale=get_layout(layout).d_qk ** -0.5,
        topk_length=p.topk_length,
        attn_sink=p.attn_sink,
        extra_k_cache=p.extra_k_cache,
        extra_indices=p.extra_indices,
        extra_topk_length=p.extra_topk_length,
    )
    assert_opcheck(torch.ops.sparse_mla.sparse_decode.default, (p.q, p.k_cache, p.indices), kwargs)


def test_sparse_decode_op_errors():
    p = to_dev(make_problem(b=2, h_q=16, topk=128, num_blocks=3, seed=6, out_dtype=torch.uint8))
    meta, _ = flash_mla.get_mla_metadata(num_sms=32)
    with pytest.raises(ValueError, match="^tile_scheduler_metadata"):
        lib.schedule_tensors(meta)  # not filled yet
    with pytest.raises(TypeError, match="^tile_scheduler_metadata"):
        lib.sparse_decode(p.q, p.k_cache, p.indices, None)
    lib.sparse_decode(p.q, p.k_cache, p.indices, meta)
    st = lib.schedule_tensors(meta)
    assert st["any_split"]
    st["any_split"] = False  # a wrong False: 1-row accumulators for split batches
    if p.q.device.type == "cpu":  # checkable on the host: rejected
        with pytest.raises(ValueError, match="^any_split"):
            torch.ops.sparse_mla.sparse_decode(p.q, p.k_cache, p.indices, **st, sm_scale=0.1)
    else:  # not checkable without a sync: the op allocates full accumulators anyway
        out_f, lse_f = torch.ops.sparse_mla.sparse_decode(p.q, p.k_cache, p.indices, **st, sm_scale=0.1)
        st["any_split"] = True
        out_t, lse_t = torch.ops.sparse_mla.sparse_decode(p.q, p.k_cache, p.indices, **st, sm_scale=0.1)
        assert torch.equal(out_f, out_t) and torch.equal(lse_f, lse_t)
    st["any_split"] = True
    st["acc_rows"] = st["acc_rows"][:-1]
    with pytest.raises(ValueError, match="^acc_rows"):
        torch.ops.sparse_mla.sparse_decode(p.q, p.k_cache, p.indices, **st, sm_scale=0.1)
    with pytest.raises(TypeError, match="^q"):
        torch.ops.sparse_mla.sparse_decode(
            p.q.float(), p.k_cache, p.indices, **lib.schedule_tensors(meta), sm_scale=0.1
        )


def test_combine_op():
    g = torch.Generator().manual_seed(9)
    b, s_q, h_q, d_v = 3, 2, 16, 512
    num_splits = torch.tensor([0, 1, 4, 6], dtype=torch.int32)  # batch 0 whole, batches 1-2 split
    rows = 6
    o_acc = torch.randn(rows, s_q, h_q, d_v, generator=g)
    l_acc = torch.randn(rows, s_q, h_q, generator=g) * 3
    l_acc[4:6, 1, :4] = float("-inf")  # a query with no valid key in any split
    sink = torch.randn(h_q, generator=g)
    out = torch.full((b, s_q, h_q, d_v), 7.0)
    lse = torch.full((b, h_q, s_q), 7.0)
    num_splits, o_acc, l_acc, sink, out, lse = (t.to(DEV) for t in (num_splits, o_acc, l_acc, sink, out, lse))
    ref_out, ref_lse = out.clone(), lse.clone()
    combine_reference(o_acc, l_acc, num_splits, ref_out, ref_lse, sink)
    torch.ops.sparse_mla.combine(o_acc, l_acc, num_splits, out, lse, sink)
    assert torch.all(out[0] == 7.0) and torch.all(lse[0] == 7.0)  # batch 0 left alone
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-6)
    assert torch.all(out[2, 1, :4] == 0) and torch.all(torch.isposinf(lse[2, :4, 1]))
    assert_opcheck(torch.ops.sparse_mla.combine.default, (o_acc, l_acc, num_splits, out, lse), {"attn_sink": sink})
    if DEV == "cpu":  # (checked on the host only: reading num_splits on a GPU would sync)
        with pytest.raises(ValueError, match="^num_splits"):
            torch.ops.sparse_mla.combine(o_acc, l_acc, torch.tensor([0, 3, 2, 6], dtype=torch.int32), out, lse)
    with pytest.raises(ValueError, match="^lse_accum"):
        torch.ops.sparse_mla.combine(o_acc, l_acc[:5], num_splits, out, lse)


@pytest.mark.parametrize("layout,pbs", [("V32", 4), ("MODEL1", 3)])
def test_quantize_and_store_kv_op(layout, pbs):
    lay = get_layout(layout)
    g = torch.Generator().manual_seed(13)
    nb = 4
    if layout == "V32":
        kc = torch.randint(0, 256, (nb, pbs, 1, 656), generator=g, dtype=torch.uint8)
    else:
        bb = lay.block_bytes(pbs)
        kc = torch.randint(0, 256, (nb * bb,), generator=g, dtype=torch.uint8).as_strided(
            (nb, pbs, 1, 584), (bb, 584, 584, 1)
        )
    kc = to_device(kc, DEV)
    kv = (torch.randn(5, lay.d_qk, generator=g) * 3).to(torch.bfloat16).to(DEV)
    slots = torch.tensor([3, -1, nb * pbs - 1, 0, 6], device=DEV)
    want = expected_after_store(kc, kv, slots)
    torch.ops.sparse_mla.quantize_and_store_kv(kv, slots, kc)
    assert torch.equal(storage_bytes(kc).cpu(), want)
    assert_opcheck(torch.ops.sparse_mla.quantize_and_store_kv.default, (kv, slots, kc))


def test_abs_indices_op():
    g = torch.Generator().manual_seed(17)
    table = torch.randperm(40, generator=g)[:12].view(2, 6).int()
    table[1, 2] = -1
    pos = torch.randint(-1, 7 * 16, (2, 2, 70), generator=g, dtype=torch.int32)
    table, pos = table.to(DEV), pos.to(DEV)
    got = torch.ops.sparse_mla.abs_indices_to_kvcache_indices(pos, table, 16)
    assert torch.equal(got, abs_indices_to_kvcache_indices(pos, table, 16))
    assert_opcheck(torch.ops.sparse_mla.abs_indices_to_kvcache_indices.default, (pos, table, 16))


@pytest.mark.parametrize("layout,backend", [("V32", "inductor"), ("MODEL1", "aot_eager")])
def test_compiled_serving_step_fullgraph(layout, backend):
    """store + index conversion + decode traced as one graph (no graph break) give the eager result."""
    lay = get_layout(layout)
    pbs = 64
    p = to_dev(
        make_problem(
            b=2, h_q=16, topk=64, layout=layout, num_blocks=3, page_block_size=pbs, seed=21, out_dtype=torch.uint8
        )
    )
    g = torch.Generator().manual_seed(22)
    table = torch.tensor([[2, 0], [1, -1]], dtype=torch.int32)
    pos = torch.randint(0, 100, (2, 1, 64), generator=g, dtype=torch.int32)
    pos[1, 0, :8] = -1
    kv = (torch.randn(2, lay.d_qk, generator=g) * 0.5).to(torch.bfloat16)
    slots = torch.tensor([5, 70])
    table, pos, kv, slots = table.to(DEV), pos.to(DEV), kv.to(DEV), slots.to(DEV)
    meta, _ = flash_mla.get_mla_metadata(num_sms=4)
    lib.sparse_decode(p.q, p.k_cache, abs_indices_to_kvcache_indices(pos, table, pbs), meta)  # fill the schedule
    st = lib.schedule_tensors(meta)

    def step(kv, slots, k_cache, pos, table, q):
        torch.ops.sparse_mla.quantize_and_store_kv(kv, slots, k_cache)
        idx = torch.ops.sparse_mla.abs_indices_to_kvcache_indices(pos, table, pbs)
        return torch.ops.sparse_mla.sparse_decode(q, k_cache, idx, **st, sm_scale=lay.d_qk**-0.5)

    def fresh_cache():
        flat = storage_bytes(p.k_cache).clone()
        return flat.as_strided(p.k_cache.shape, p.k_cache.stride(), p.k_cache.storage_offset())

    k_eager, k_comp = fresh_cache(), fresh_cache()
    want_cache = expected_after_store(k_eager, kv, slots)
    oe, le = step(kv, slots, k_eager, pos, table, p.q)
    oc, lc = torch.compile(step, fullgraph=True, backend=backend)(kv, slots, k_comp, pos, table, p.q)
    assert torch.equal(storage_bytes(k_eager).cpu(), want_cache)
    assert torch.equal(storage_bytes(k_comp).cpu(), want_cache)
    assert torch.equal(oe, oc) and torch.equal(le, lc)
    ro, rl = sparse_decode_reference(p.q, k_eager, abs_indices_to_kvcache_indices(pos, table, pbs), None, 512)
    check_decode_close(oc, lc, ro, rl)


FORGED = {
    "requests past b": lambda st: st["tile_scheduler_metadata"].__setitem__((0, slice(0, 2)), 1000),
    "negative request": lambda st: st["tile_scheduler_metadata"].__setitem__((0, 0), -3),
    "negative num_splits": lambda st: st["acc_rows"].copy_(torch.tensor([-500, 0, 7])),
    "num_splits past the rows": lambda st: st["acc_rows"].copy_(torch.tensor([0, 1000, 3])),
    "2**31-1 blocks": lambda st: st["tile_scheduler_metadata"].__setitem__((0, 3), 2**31 - 1),
    "2**31-1 main blocks": lambda st: st["main_blocks"].fill_(2**31 - 1),
    "huge split index": lambda st: st["tile_scheduler_metadata"].__setitem__((slice(None), 4), 10**6),
}


@pytest.mark.parametrize("case", list(FORGED))
def test_forged_schedule_is_rejected_or_bounded(case):
    """Scheduler tensors the scheduler cannot have made: rejected on the host; on a device (no
    sync possible) the op bounds them, and the kernels then stay inside every buffer."""
    from sparse_mla.decode import resolve_backend, run_decode
    from sparse_mla.decode.problem import validate_sparse_decode
    from sparse_mla.decode.scheduler import ScheduleTable

    p = to_dev(make_problem(b=2, s_q=1, h_q=16, topk=200, seed=31))
    meta, _ = flash_mla.get_mla_metadata(num_sms=16)
    lib.sparse_decode(p.q, p.k_cache, p.indices, meta)
    st = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in lib.schedule_tensors(meta).items()}
    rows = 2 + st["tile_scheduler_metadata"].shape[0]
    legit = bound_schedule_tensors(
        st["tile_scheduler_metadata"], st["acc_rows"], st["main_blocks"], st["num_blocks"], 2, 200, 0, rows
    )
    for t, u in zip(
        legit, (st["tile_scheduler_metadata"], st["acc_rows"], st["main_blocks"], st["num_blocks"]), strict=True
    ):
        assert torch.equal(t, u)  # the scheduler's own tensors pass unchanged
    FORGED[case](st)
    if p.q.device.type == "cpu":
        with pytest.raises(
            ValueError, match="^(tile_scheduler_metadata|num_splits|main_blocks|num_blocks): values out of range"
        ):
            torch.ops.sparse_mla.sparse_decode(p.q, p.k_cache, p.indices, **st, sm_scale=0.1)
    md, ns, mb, nb = bound_schedule_tensors(
        st["tile_scheduler_metadata"], st["acc_rows"], st["main_blocks"], st["num_blocks"], 2, 200, 0, rows
    )
    assert int(md[:, 0].min()) >= 0 and int(md[:, 1].max()) <= 1 and int(md[:, 3].max()) <= 4
    assert int(ns.min()) >= 0 and int(ns.max()) <= rows - 1 and bool((ns[1:] >= ns[:-1]).all()) and int(ns[0]) == 0
    # the kernels run on the bounded tensors without touching memory outside their buffers
    q = validate_sparse_decode(q=p.q, k_cache=p.k_cache, indices=p.indices)
    table = ScheduleTable(md.shape[0], md, ns, mb, [], 0, nb, ns, rows - 1)
    out, lse = run_decode(q, resolve_backend(q), table)
    assert out.shape == (2, 1, 16, 512) and lse.shape == (2, 16, 1)


def test_compiled_decode_checks_what_it_can_trace():
    """Under torch.compile the decode checks, while tracing, what an eager call checks and the
    graph fixes: the scheduler object's configuration (a reused object filled for another shape
    ran that other schedule before), the Python scalars, and out/lse's shape, dtype and device
    (they were broadcast-filled or cast before). A failed check raises the library's own
    exception, as the eager call does, when the compiled function runs (before: Dynamo's
    ``torch._dynamo.exc.Unsupported: Observed exception``, the library's message on a line of its
    middle)."""
    p = to_dev(make_problem(b=2, h_q=16, topk=64, seed=31))
    q, kc, idx = p.q, p.k_cache, p.indices
    meta, _ = flash_mla.get_mla_metadata(num_sms=4)
    want_o, want_l = flash_mla.flash_mla_with_kvcache(q, kc, None, None, 512, meta, is_fp8_kvcache=True, indices=idx)

    def call(q, kc, ix, **kw):
        return flash_mla.flash_mla_with_kvcache(q, kc, None, None, 512, meta, is_fp8_kvcache=True, indices=ix, **kw)

    def compiled(fn, *args):
        torch._dynamo.reset()
        return torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)

    o, lse_c = compiled(call, q, kc, idx)  # the configuration it was filled for
    assert torch.equal(o, want_o) and torch.equal(lse_c, want_l)
    longer = torch.cat([idx, idx[..., :36]], dim=-1)  # topk 64 -> 100
    with pytest.raises(
        ValueError, match="^tile_scheduler_metadata: this object was filled for another configuration .*topk 64 -> 100"
    ):
        compiled(call, q, kc, longer)
    with pytest.raises(ValueError, match="has_topk_length False -> True"):
        compiled(
            lambda q, kc, ix, n: call(q, kc, ix, topk_length=n),
            q,
            kc,
            idx,
            torch.full((2,), 64, dtype=torch.int32, device=DEV),
        )
    with pytest.raises(TypeError, match="^softmax_scale: expected a float or None, got bool$"):
        compiled(lambda q, kc, ix: call(q, kc, ix, softmax_scale=True), q, kc, idx)
    with pytest.raises(ValueError, match="^head_dim_v: expected 512, got 512.0$"):
        compiled(
            lambda q, kc, ix: flash_mla.flash_mla_with_kvcache(
                q, kc, None, None, 512.0, meta, is_fp8_kvcache=True, indices=ix
            ),
            q,
            kc,
            idx,
        )
    bad_out = torch.empty(2, 3, 16, 512, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match=r"^out: expected shape \[2, 1, 16, 512\], got \[2, 3, 16, 512\]$"):
        compiled(lambda q, kc, ix, o: call(q, kc, ix, out=o), q, kc, idx, bad_out)
    with pytest.raises(TypeError, match="^lse: expected a torch.float32 tensor$"):
        compiled(
            lambda q, kc, ix, lse_buf: call(q, kc, ix, lse=lse_buf),
            q,
            kc,
            idx,
            torch.empty(2, 16, 1, dtype=torch.float64, device=DEV),
        )
    out = torch.empty(2, 1, 16, 512, dtype=torch.bfloat16, device=DEV)
    o, _ = compiled(lambda q, kc, ix, o: call(q, kc, ix, out=o), q, kc, idx, out)
    assert torch.equal(out, want_o)


@pytest.mark.parametrize("backend", ["aot_eager"] + (["inductor"] if DEV == "cuda" else []))
def test_compiled_decode_raises_the_librarys_own_errors(backend):
    """fullgraph=True: a bad argument gives the exception an eager call gives, its type and its
    message, not Dynamo's; with dynamic shapes too (a symbolic size or number in the message)."""
    p = to_dev(make_problem(b=2, h_q=16, topk=64, seed=32))
    q, kc, idx = p.q, p.k_cache, p.indices
    meta, _ = flash_mla.get_mla_metadata(num_sms=4)
    want, _ = flash_mla.flash_mla_with_kvcache(q, kc, None, None, 512, meta, is_fp8_kvcache=True, indices=idx)

    def decode(q, kc, ix, head_dim_v):
        out, lse = flash_mla.flash_mla_with_kvcache(
            q, kc, None, None, head_dim_v, meta, is_fp8_kvcache=True, indices=ix
        )
        return out.float() * 2, lse  # (an exact op after the decode, whatever the backend)

    def run(*args, dynamic=None, fn=decode):
        torch._dynamo.reset()
        return torch.compile(fn, fullgraph=True, backend=backend, dynamic=dynamic)(*args)

    for dynamic in (None, True):
        with pytest.raises(ValueError, match="^head_dim_v: expected 512, got 256$"):
            run(q, kc, idx, 256, dynamic=dynamic)
        with pytest.raises(TypeError, match=r"^q: expected a bf16 tensor \[b, s_q, h_q, d_qk\]$"):
            run(q.float(), kc, idx, 512, dynamic=dynamic)
        with pytest.raises(ValueError, match=r"^q: expected 4 dims \[b, s_q, h_q, d_qk\], got shape \[1, 16, 576\]$"):
            run(q[0], kc, idx, 512, dynamic=dynamic)
    with pytest.raises(TypeError, match="^tile_scheduler_metadata: expected the FlashMLASchedMeta"):
        run(q, kc, idx, fn=lambda q, kc, ix: flash_mla.flash_mla_with_kvcache(q, kc, None, None, 512, None, indices=ix))
    with pytest.raises(TypeError, match=r"^block_table: expected an int32 tensor"):  # dense without a table
        run(q, kc, fn=lambda q, kc: flash_mla.flash_mla_with_kvcache(q, kc, None, None, 512, meta))
    with pytest.raises(ValueError, match="^backend: "):  # an unknown name, as eager calls say it
        run(q, kc, idx, fn=lambda q, kc, ix: flash_mla.flash_mla_with_kvcache(
            q, kc, None, None, 512, meta, is_fp8_kvcache=True, indices=ix, backend="bogus"))  # fmt: skip
    # the error is raised even where the call's outputs go unused (the caller reads its out=)
    out = torch.empty(2, 1, 16, 512, dtype=torch.bfloat16, device=DEV)

    def into(q, kc, ix, o):
        flash_mla.flash_mla_with_kvcache(q, kc, None, None, 256, meta, is_fp8_kvcache=True, indices=ix, out=o)
        return o.float().sum()

    with pytest.raises(ValueError, match="^head_dim_v: expected 512, got 256$"):
        run(q, kc, idx, out, fn=into)
    # one compiled function: a bad call raises, a good one after it compiles anew and runs
    torch._dynamo.reset()
    f = torch.compile(decode, fullgraph=True, backend=backend)
    for head_dim_v in (256, 512, 300, 512):
        if head_dim_v != 512:
            with pytest.raises(ValueError, match=f"^head_dim_v: expected 512, got {head_dim_v}$"):
                f(q, kc, idx, head_dim_v)
        else:
            assert torch.equal(f(q, kc, idx, 512)[0], want.float() * 2)


def test_the_argument_error_op_raises_its_exception():
    cpu = torch.device("cpu")
    for exc_type, cls in (
        ("TypeError", TypeError),
        ("ValueError", ValueError),
        ("NotImplementedError", NotImplementedError),
    ):
        with pytest.raises(cls, match="^q: bad$"):
            torch.ops.sparse_mla.argument_error(exc_type, "q: bad", [2, 3], torch.float32, cpu)
    # an exported program must not carry the error: torch.export raises it at once
    p = to_dev(make_problem(b=2, h_q=16, topk=64, seed=33))
    meta, _ = flash_mla.get_mla_metadata(num_sms=4)
    flash_mla.flash_mla_with_kvcache(p.q, p.k_cache, None, None, 512, meta, is_fp8_kvcache=True, indices=p.indices)

    class Decode(torch.nn.Module):
        def forward(self, q, kc, ix):
            return flash_mla.flash_mla_with_kvcache(q, kc, None, None, 256, meta, is_fp8_kvcache=True, indices=ix)

    with pytest.raises(ValueError, match="^head_dim_v: expected 512, got 256$"):
        torch.export.export(Decode(), (p.q, p.k_cache, p.indices))


def test_a_plan_set_by_hand_is_refused():
    """A scheduler object's fields are public: a plan taken from another object (another batch)
    ran another schedule (an index error on the CPU, a heap write in the interpreter, or a silently
    wrong result) and a filled flag without a configuration raised AttributeError."""
    big_p = to_dev(make_problem(b=3, h_q=16, topk=64, seed=41))
    small_p = to_dev(make_problem(b=2, h_q=16, topk=64, seed=42))
    big, _ = flash_mla.get_mla_metadata(num_sms=4)
    small, _ = flash_mla.get_mla_metadata(num_sms=4)
    for p, m in ((big_p, big), (small_p, small)):
        flash_mla.flash_mla_with_kvcache(p.q, p.k_cache, None, None, 512, m, is_fp8_kvcache=True, indices=p.indices)
    small.plan = big.plan
    with pytest.raises(ValueError, match="tile_scheduler_metadata: its plan does not belong"):
        flash_mla.flash_mla_with_kvcache(
            small_p.q, small_p.k_cache, None, None, 512, small, is_fp8_kvcache=True, indices=small_p.indices
        )
    fresh, _ = flash_mla.get_mla_metadata(num_sms=4)
    fresh.have_initialized = True
    with pytest.raises(ValueError, match="tile_scheduler_metadata: its plan does not belong"):
        flash_mla.flash_mla_with_kvcache(
            small_p.q, small_p.k_cache, None, None, 512, fresh, is_fp8_kvcache=True, indices=small_p.indices
        )


@pytest.mark.skipif(DEV != "cpu", reason="the op checks the block counts on the host")
def test_the_op_refuses_block_counts_of_another_topk():
    # schedule_tensors() of an object filled for topk 64, given to a topk 128 call without
    # topk_length: every batch's block count is fixed by topk, and these are not it
    p64 = make_problem(b=2, h_q=16, topk=64, seed=43)
    p128 = make_problem(b=2, h_q=16, topk=128, seed=43)
    meta, _ = flash_mla.get_mla_metadata(num_sms=4)
    lib.sparse_decode(p64.q, p64.k_cache, p64.indices, meta)
    st = lib.schedule_tensors(meta)
    with pytest.raises(ValueError, match="main_blocks: expected 2 per batch for topk 128"):
        torch.ops.sparse_mla.sparse_decode(p128.q, p128.k_cache, p128.indices, **st, sm_scale=0.05)
