"""The split-KV workspace and the caller's output buffers (no workspace allocated per call).

* the scheduler's ``acc_rows``: rows for split batches only, at most 2 per partition;
* :func:`sparse_mla.decode_workspace_bytes` bounds what any plan holds;
* ``out=``/``lse=``: written in place (views included), the same values as without;
* steady state: the plan's workspace is reused, nothing is allocated per call (counted on the
  CPU by the allocator function, on a GPU with ``torch.cuda.memory_stats``); a CUDA graph keeps a
  workspace of its own, so it outlives the scheduler object.
"""

from __future__ import annotations

import gc
import os
import random

import pytest
import torch
from helpers import check_decode_close, make_problem

import sparse_mla as flash_mla
import sparse_mla.library as lib
from sparse_mla.decode import workspace as ws_mod
from sparse_mla.decode.plan import decode_workspace_bytes
from sparse_mla.decode.scheduler import MAX_ACC_ROWS_PER_PART, batch_num_blocks, compute_num_sm_parts, schedule
from sparse_mla.reference import sparse_decode_reference

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
KERNELS = ON_GPU or os.environ.get("TRITON_INTERPRET", "0") == "1"
needs_kernels = pytest.mark.skipif(not KERNELS, reason="kernels need a GPU or TRITON_INTERPRET=1")
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
# memory statistics and graph capture need PyTorch's caching allocator (memcheck runs turn it off)
needs_caching_allocator = pytest.mark.skipif(
    not ON_GPU or os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1", reason="needs CUDA's caching allocator"
)


def _call(p, meta, **kw):
    return flash_mla.flash_mla_with_kvcache(
        p.q, p.k_cache, None, None, 512, meta, is_fp8_kvcache=True, **p.api_kwargs(), **kw
    )


# ------------------------------------------------------------------ acc_rows


@pytest.mark.parametrize("seed", range(40))
def test_acc_rows_count_split_batches_only(seed):
    rnd = random.Random(seed)
    b = rnd.randint(1, 40)
    parts = rnd.randint(1, 70)
    blocks = [rnd.randint(1, 40) for _ in range(b)]
    t = schedule(blocks, parts)
    ns, acc = t.num_splits.tolist(), t.acc_rows.tolist()
    assert acc[0] == 0 and t.num_acc_rows == acc[-1]
    for i in range(b):
        n = ns[i + 1] - ns[i]
        assert acc[i + 1] - acc[i] == (n if n > 1 else 0)
    assert t.num_acc_rows <= MAX_ACC_ROWS_PER_PART * parts
    assert t.any_split == any(ns[i + 1] - ns[i] > 1 for i in range(b))


@pytest.mark.parametrize("seed", range(20))
def test_workspace_bound_holds_for_random_steps(seed):
    rnd = random.Random(seed)
    b, s_q, h_q = rnd.randint(1, 200), rnd.randint(1, 4), rnd.choice([1, 16, 32, 64, 100, 128])
    num_sms = rnd.choice([8, 78, 132, 148])
    topk = rnd.choice([64, 512, 2048])
    lens = [rnd.randint(0, topk) for _ in range(b)]
    _, total = batch_num_blocks(b, topk, lens)
    bound = decode_workspace_bytes(b, s_q, h_q, num_sms=num_sms)
    for hpc in (16, 64):
        t = schedule(total, compute_num_sm_parts(num_sms, s_q, h_q, hpc))
        used = ws_mod.accumulator_bytes(t.num_acc_rows, s_q, h_q)
        assert used <= bound, (t.num_acc_rows, used, bound)


def test_workspace_bytes_of_documented_shapes():
    # 132 SMs, h_q 128, s_q 2: 33 partitions of 2 x 64 heads; at most 66 rows
    assert decode_workspace_bytes(128, 2, 128, num_sms=132) == 66 * 2 * 128 * 513 * 4
    # a mixed batch as one request: one partition, nothing is ever split
    assert decode_workspace_bytes(1, 16384, 128, num_sms=132) == 8
    with pytest.raises(ValueError, match="^h_q"):
        decode_workspace_bytes(1, 1, 129)
    with pytest.raises(ValueError, match="^b"):
        decode_workspace_bytes(0, 1, 16)
    # num_sms as get_mla_metadata takes it, d_v as the decode has it, NumPy integers accepted
    for kw, name in ((dict(num_sms=2000), "^num_sms"), (dict(num_sms=True), "^num_sms"), (dict(d_v=7), "^d_v")):
        with pytest.raises(ValueError, match=name):
            decode_workspace_bytes(128, 2, 128, **kw)
    np = pytest.importorskip("numpy")
    assert decode_workspace_bytes(np.int64(128), 2, 128, num_sms=np.int32(132)) == 66 * 2 * 128 * 513 * 4


# ------------------------------------------------------------------ out= / lse=


@needs_kernels
@pytest.mark.parametrize("num_sms", [2, 132])  # whole batches, split batches
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_out_and_lse_buffers_are_written_in_place(num_sms, backend):
    p = make_problem(b=2, s_q=2, h_q=16, topk=128, seed=31, topk_length=[100, 40], attn_sink=[0.3, -1.0]).to(DEVICE)
    meta, _ = flash_mla.get_mla_metadata(num_sms=num_sms)
    ref_out, ref_lse = _call(p, meta, backend=backend)
    # strided views: every other head row of a bigger out, lse transposed storage
    big = torch.full((2, 2, 32, 512), 7.0, dtype=torch.bfloat16, device=DEVICE)
    out = big[:, :, ::2]
    lse = torch.full((2, 2, 16), 5.0, device=DEVICE).transpose(1, 2)
    o, l_ = _call(p, meta, backend=backend, out=out, lse=lse)
    assert o is out and l_ is lse
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert torch.all(big[:, :, 1::2] == 7.0)  # the rows between were not touched
    ref = sparse_decode_reference(p.q, p.k_cache, p.indices, **p.ref_kwargs())
    check_decode_close(out.float().cpu(), lse.cpu(), ref[0].cpu(), ref[1].cpu())


@needs_kernels
def test_out_and_lse_through_the_op_entry():
    p = make_problem(b=2, s_q=1, h_q=16, topk=128, seed=32).to(DEVICE)
    meta, _ = flash_mla.get_mla_metadata(num_sms=132)
    ref = lib.sparse_decode(p.q, p.k_cache, p.indices, meta)
    out = torch.empty(2, 1, 16, 512, dtype=torch.bfloat16, device=DEVICE)
    lse = torch.empty(2, 16, 1, device=DEVICE)
    o, l_ = _call(p, meta, out=out, lse=lse)
    assert o is out and torch.equal(out, ref[0]) and torch.equal(lse, ref[1])


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(out=torch.empty(2, 1, 16, 512)), TypeError, "^out: expected dtype"),
        (dict(out=torch.empty(2, 1, 16, 256, dtype=torch.bfloat16)), ValueError, "^out: expected shape"),
        (dict(out=torch.empty(2, 1, 512, 16, dtype=torch.bfloat16).transpose(2, 3)), ValueError, "^out: the last"),
        (dict(lse=torch.empty(2, 1, 16)), ValueError, "^lse: expected shape"),
        (dict(lse=torch.empty(2, 16, 1, dtype=torch.float64)), TypeError, "^lse: expected dtype"),
        (dict(out="x"), TypeError, "^out: expected a torch.Tensor"),
    ],
)
def test_bad_out_and_lse_are_named(kw, exc, match):
    p = make_problem(b=2, s_q=1, h_q=16, topk=64, seed=33)
    meta, _ = flash_mla.get_mla_metadata()
    with pytest.raises(exc, match=match):
        _call(p, meta, backend="reference", **kw)


# ------------------------------------------------------------------ steady state: no allocation


@needs_kernels
def test_workspace_is_allocated_once_per_scheduler_object(monkeypatch):
    p = make_problem(b=2, s_q=1, h_q=16, topk=256, seed=34).to(DEVICE)
    meta, _ = flash_mla.get_mla_metadata(num_sms=132)
    calls = []
    real = ws_mod.split_accumulators

    def counting(*a, **k):
        calls.append(a)
        return real(*a, **k)

    monkeypatch.setattr(ws_mod, "split_accumulators", counting)
    import sparse_mla.decode.plan as plan_mod

    monkeypatch.setattr(plan_mod, "split_accumulators", counting)
    first = _call(p, meta)
    assert len(calls) == 1 and meta.table.any_split  # the plan's, sized by the schedule
    ws_ptrs = [t.data_ptr() for t in meta.plan.workspace]
    for _ in range(3):
        again = _call(p, meta)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    assert len(calls) == 1  # reused: no per-call workspace
    assert [t.data_ptr() for t in meta.plan.workspace] == ws_ptrs
    assert meta.workspace_bytes == ws_mod.accumulator_bytes(meta.table.num_acc_rows, 1, 16)
    assert 0 < meta.workspace_bytes <= decode_workspace_bytes(2, 1, 16, num_sms=132)


@needs_caching_allocator
def test_no_device_allocation_in_steady_state():
    p = make_problem(b=4, s_q=2, h_q=64, topk=512, num_blocks=20, seed=35).to("cuda")
    meta, _ = flash_mla.get_mla_metadata()
    out = torch.empty(4, 2, 64, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(4, 64, 2, device="cuda")
    _call(p, meta, out=out, lse=lse)
    assert meta.table.any_split
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    for _ in range(100):
        _call(p, meta, out=out, lse=lse)
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    assert after["allocation.all.allocated"] == before["allocation.all.allocated"]
    assert after["reserved_bytes.all.peak"] == before["reserved_bytes.all.peak"]
    # without out=: two output tensors per call from the caching allocator, no new device memory
    for _ in range(100):
        _call(p, meta)
    torch.cuda.synchronize()
    final = torch.cuda.memory_stats()
    assert final["allocation.all.allocated"] - after["allocation.all.allocated"] == 200
    assert final["reserved_bytes.all.peak"] == before["reserved_bytes.all.peak"]


@needs_caching_allocator
def test_graph_keeps_its_own_workspace():
    p = make_problem(b=2, s_q=2, h_q=128, topk=512, num_blocks=20, seed=36).to("cuda")
    meta, _ = flash_mla.get_mla_metadata()
    ref = _call(p, meta)
    assert meta.table.any_split
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = _call(p, meta)
    del meta
    gc.collect()
    junk = torch.full((1 << 24,), float("nan"), device="cuda")  # reuse freed memory, if any was
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
    del junk


# ------------------------------------------------------------------ repeated calls: the shortcut


@needs_kernels
def test_repeated_calls_skip_validation_but_not_the_data(monkeypatch):
    import sparse_mla.decode.eager as ops

    p1 = make_problem(b=2, s_q=1, h_q=16, topk=128, seed=40, topk_length=[128, 60]).to(DEVICE)
    p2 = make_problem(b=2, s_q=1, h_q=16, topk=128, seed=41, topk_length=[128, 60]).to(DEVICE)
    meta, _ = flash_mla.get_mla_metadata(num_sms=132)
    _call(p1, meta)
    n = []
    real = ops.validate_sparse_decode
    monkeypatch.setattr(ops, "validate_sparse_decode", lambda **kw: n.append(1) or real(**kw))
    got = _call(p2, meta)  # same geometry, other data: no validation, p2's data
    assert n == []
    fresh, _ = flash_mla.get_mla_metadata(num_sms=132)
    want = _call(p2, fresh)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert meta.call_cache.problem.q is None  # the object keeps no tensor of the call alive
    # anything else: the full checks run and name the argument
    with pytest.raises(TypeError, match="^q: expected dtype"):
        flash_mla.flash_mla_with_kvcache(
            p2.q.float(), p2.k_cache, None, None, 512, meta, is_fp8_kvcache=True, **p2.api_kwargs()
        )
    with pytest.raises(ValueError, match="^tile_scheduler_metadata: this object was filled for another"):
        flash_mla.flash_mla_with_kvcache(
            p2.q[:1], p2.k_cache, None, None, 512, meta, is_fp8_kvcache=True, indices=p2.indices[:1]
        )
    with pytest.raises(ValueError, match="^softmax_scale"):
        _call(p2, meta, softmax_scale=-1.0)
    assert len(n) == 4  # the fresh object's first call and the three bad calls


@needs_gpu
def test_direct_launch_matches_triton_launch(monkeypatch):
    from sparse_mla.core import launcher

    p = make_problem(b=3, s_q=2, h_q=64, topk=256, num_blocks=12, seed=42, attn_sink=[0.5]).to("cuda")
    meta, _ = flash_mla.get_mla_metadata()
    ref = [t.clone() for t in _call(p, meta)]
    n_keys = len(launcher._CACHE)
    assert n_keys >= 2  # the decode kernel and the combine are remembered
    from sparse_mla.decode.kernels import combine, hopper, portable

    decode_kernel = hopper._sparse_decode_gluon_kernel if meta.backend == "hopper" else portable._sparse_decode_kernel
    through_triton = []

    def counted(run):
        def run_counted(*a, **kw):
            if not kw.get("warmup"):  # launches; a compile-only warmup (launcher.launch's prepare) is not one
                through_triton.append(1)
            return run(*a, **kw)

        return run_counted

    for k in (decode_kernel, combine._combine_kernel):
        monkeypatch.setattr(k, "run", counted(k.run))
    for _ in range(3):
        got = _call(p, meta)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert through_triton == []  # relaunched directly
    # a q view 2 bytes past a 16-byte boundary: another specialisation, launched by Triton first
    big = torch.empty(p.q.numel() + 8, dtype=torch.bfloat16, device="cuda")
    q_off = big[1 : 1 + p.q.numel()].view(p.q.shape)
    q_off.copy_(p.q)
    meta2, _ = flash_mla.get_mla_metadata()
    assert q_off.data_ptr() % 16 == 2
    got = flash_mla.flash_mla_with_kvcache(
        q_off, p.k_cache, None, None, 512, meta2, is_fp8_kvcache=True, **p.api_kwargs()
    )
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert len(launcher._CACHE) > n_keys
    assert len(through_triton) == 1  # the decode kernel's new specialisation went through Triton once
    monkeypatch.setenv("SPARSE_MLA_DIRECT_LAUNCH", "0")
    got = _call(p, meta)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert len(through_triton) == 3


@pytest.mark.parametrize("direct", [True, False])
def test_launch_prepares_the_compiled_kernel_before_its_first_launch(direct, monkeypatch):
    # launcher.launch(prepare=...): a function attribute (the carveout hint) must be on the kernel
    # before its first launch, since a CUDA graph captured at the first call keeps what it saw
    from sparse_mla.core import launcher

    events = []

    class Compiled:
        function = 1234
        packed_metadata = None

        def run(self, *a):
            events.append("run")

    compiled = Compiled()

    class Kernel:
        arg_names = ["x", "N"]

        def warmup(self, *args, grid, **kw):
            events.append("compile")
            return compiled

        def __getitem__(self, grid):
            def go(*args, **kw):
                events.append("launch")
                return compiled

            return go

    monkeypatch.setattr(launcher, "interpreting", lambda: False)
    monkeypatch.setattr(launcher, "direct_launch_enabled", lambda: direct)
    monkeypatch.setattr(launcher, "_hooks_installed", lambda: False)
    monkeypatch.setattr(launcher, "_CACHE", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launcher, "_current_stream", lambda dev: 0)

    def prepare(c, dev):
        assert c is compiled and dev == 0
        events.append("prepare")

    k = Kernel()
    for _ in range(2):
        launcher.launch(k, (1, 1, 1), (7,), {"N": 3}, {"num_warps": 4}, prepare)
    first = ["compile", "prepare", "launch"]
    assert events == first + (["prepare", "run"] if direct else first)


class _NewStorage(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the tensor operations whose result owns storage that none of its inputs had: every
    allocation of a tensor (factories, copies, arithmetic results), whichever Python code asks."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = set()
        for a in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor):
                seen.add(a.untyped_storage().data_ptr())
        for o in torch.utils._pytree.tree_leaves(out):
            if (
                isinstance(o, torch.Tensor)
                and o.untyped_storage().nbytes()
                and o.untyped_storage().data_ptr() not in seen
            ):
                self.ops.append(str(func))
        return out


@pytest.mark.parametrize("backend", ["hopper", "portable"])
def test_repeated_calls_with_out_allocate_no_tensor(backend):
    """The steady state of repeated eager calls on the CPU: with the kernels' launches stubbed (nothing runs, the
    whole Python path does), 100 repeated calls with ``out=``/``lse=`` create no tensor at all,
    split workspace included; without ``out=`` a call creates exactly its two outputs."""
    if ON_GPU:
        pytest.skip("stubbed launches run on CPU tensors; on a GPU test_no_device_allocation_in_steady_state counts")
    if not KERNELS:
        pytest.skip("the launch wrappers need TRITON_INTERPRET=1")
    from benchmarks.launch_stub import stub_compiled_launches

    p = make_problem(b=4, s_q=2, h_q=64, topk=512, num_blocks=20, seed=37)
    out = torch.empty(4, 2, 64, 512, dtype=torch.bfloat16)
    lse = torch.empty(4, 64, 2)
    with stub_compiled_launches() as log:
        meta, _ = flash_mla.get_mla_metadata(num_sms=132)
        call = lambda **kw: flash_mla.flash_mla_with_kvcache(  # noqa: E731
            p.q, p.k_cache, None, None, 512, meta, is_fp8_kvcache=True, backend=backend, **p.api_kwargs(), **kw
        )
        call(out=out, lse=lse)
        assert meta.table.any_split  # split requests: the workspace and the combine are in play
        log.clear()
        with _NewStorage() as counter:
            for _ in range(100):
                assert call(out=out, lse=lse)[0] is out
        assert counter.ops == []
        assert len(log) == 200  # every call still launched the decode and the combine
        with _NewStorage() as counter:
            for _ in range(10):
                call()
        assert len(counter.ops) == 20, counter.ops  # out and lse, nothing else
