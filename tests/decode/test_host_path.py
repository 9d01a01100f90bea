"""The host path of repeated eager decode calls: launches replayed from a recipe.

A scheduler object's cache entry (one per call geometry) keeps a
:class:`~sparse_mla.core.launcher.Replay` of its launches; a repeated call with the same
geometry only substitutes its tensors. Run with Triton's compiled launcher stubbed
(:mod:`benchmarks.launch_stub`), so on a CPU too: every launch a call makes is recorded
as the compiled launcher would get it, and compared with what the normal path (Triton's, with
``SPARSE_MLA_DIRECT_LAUNCH=0``) passes for the same call.
"""

from __future__ import annotations

import os

import pytest
import torch
import triton
from helpers import make_problem

import sparse_mla as flash_mla
from sparse_mla.core import launcher
from sparse_mla.decode import eager as ops

KERNELS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1"
pytestmark = pytest.mark.skipif(not KERNELS, reason="the launch wrappers need a GPU or TRITON_INTERPRET=1")

BACKENDS = ("hopper", "portable")


@pytest.fixture
def log():
    if torch.cuda.is_available():  # make_problem's tensors are CPU tensors: a CUDA machine would refuse them
        pytest.skip("stubbed launches run on CPU tensors under the interpreter; the GPU tests below launch for real")
    from benchmarks.launch_stub import stub_compiled_launches

    with stub_compiled_launches() as records:
        yield records


def _outputs(p):
    b, s_q, h_q, _ = p.q.shape
    return torch.empty(b, s_q, h_q, 512, dtype=torch.bfloat16), torch.empty(b, h_q, s_q, dtype=torch.float32)


def _call(p, meta, backend, **kw):
    kw = {**p.api_kwargs(), **kw}
    return flash_mla.flash_mla_with_kvcache(p.q, p.k_cache, None, None, 512, meta, is_fp8_kvcache=True,
                                            backend=backend, **kw)  # fmt: skip


def _launches(log, fn):
    log.clear()
    result = fn()
    return list(log), result


def _slow(log, fn, monkeypatch):
    """The launches of ``fn()`` through Triton's path."""
    with monkeypatch.context() as m:
        m.setenv("SPARSE_MLA_DIRECT_LAUNCH", "0")
        return _launches(log, fn)


def _with_outputs_of(res, launches, res_launches):
    """``launches`` (made by a call that returned ``res_launches``) with the pointers of the
    outputs in ``res`` instead (fresh outputs of two calls differ)."""
    mapping = {a.data_ptr(): b.data_ptr() for a, b in zip(res_launches, res, strict=True)}

    def sub(a):
        return tuple(mapping.get(x, x) for x in a) if isinstance(a, tuple) else mapping.get(a, a)

    return [(k, g, tuple(sub(a) for a in args)) for k, g, args in launches]


def _replay_of(meta):
    entry = meta.call_cache
    return None if entry is None else entry.replay


def _pointers(launches) -> set:
    flat = set()
    for _, _, args in launches:
        for a in args:
            flat.update(a if isinstance(a, tuple) else (a,))
    return flat


def _problem(seed=0, **kw):
    base = dict(b=2, s_q=2, h_q=16, topk=128, num_blocks=6, topk_length=[128, 70])
    return make_problem(seed=seed, **{**base, **kw})


FEATURES = {
    "plain": dict(topk_length=None),
    "topk_length+sink": dict(attn_sink=[0.5, -1.0]),
    "extra": dict(extra_topk=64, extra_topk_length=[64, 10]),
    "model1": dict(layout="MODEL1"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("given_outputs", [True, False])
def test_replay_passes_the_new_tensors_as_the_normal_path_would(log, monkeypatch, backend, feature, given_outputs):
    p1 = _problem(seed=1, **FEATURES[feature])
    p2 = _problem(seed=2, **FEATURES[feature])  # the same geometry, other tensors
    meta, _ = flash_mla.get_mla_metadata()
    outs = [_outputs(p1), _outputs(p1)] if given_outputs else [(None, None), (None, None)]
    first, _ = _launches(log, lambda: _call(p1, meta, backend, out=outs[0][0], lse=outs[0][1]))
    replay = _replay_of(meta)
    assert isinstance(replay, launcher.Replay)
    runs = []
    monkeypatch.setattr(
        launcher.Replay, "run", lambda self, t, _run=launcher.Replay.run: runs.append(1) or _run(self, t)
    )
    got, res = _launches(log, lambda: _call(p2, meta, backend, out=outs[1][0], lse=outs[1][1]))
    assert runs == [1] and _replay_of(meta) is replay
    want, res_slow = _slow(log, lambda: _call(p2, meta, backend, out=outs[1][0], lse=outs[1][1]), monkeypatch)
    assert runs == [1, 1]  # tried, refused (direct path off)
    assert len(got) == len(first) >= 1
    if given_outputs:
        assert res[0] is outs[1][0] and res[1] is outs[1][1]
    else:
        assert res[0].shape == res_slow[0].shape and res[0].dtype == torch.bfloat16 and res[1].dtype == torch.float32
    assert got == _with_outputs_of(res, want, res_slow)
    # p2's tensors, not p1's
    ptrs = _pointers(got)
    assert p2.q.data_ptr() in ptrs and p1.q.data_ptr() not in ptrs
    assert p2.indices.data_ptr() in ptrs and p1.indices.data_ptr() not in ptrs
    assert p2.k_cache.data_ptr() in ptrs and p1.k_cache.data_ptr() not in ptrs
    if p1.extra_k_cache is not None:
        assert p2.extra_indices.data_ptr() in ptrs and p1.extra_indices.data_ptr() not in ptrs
        assert p2.extra_topk_length.data_ptr() in ptrs and p1.extra_topk_length.data_ptr() not in ptrs


def _strided_q(p):
    b, s_q, h_q, d = p.q.shape
    return torch.zeros(b, s_q, h_q + 3, d, dtype=p.q.dtype)[:, :, :h_q].copy_(p.q)


def _misaligned_q(p):
    flat = torch.zeros(p.q.numel() + 1, dtype=p.q.dtype)
    return flat[1:].view(p.q.shape).copy_(p.q)  # 2 bytes past a 16-byte boundary


def _bigger_pool(p):
    raw = p.k_cache.view(torch.uint8)
    return torch.cat([raw, torch.zeros((2, *raw.shape[1:]), dtype=torch.uint8)]).view(p.k_cache.dtype)


#: changes a scheduler object accepts: each must give a new replay with the new launch arguments
CHANGES = {
    "q strides": lambda p: dict(q=_strided_q(p)),
    "q alignment": lambda p: dict(q=_misaligned_q(p)),
    "k_cache dtype": lambda p: dict(k_cache=p.k_cache.view(torch.uint8)),
    "k_cache shape": lambda p: dict(k_cache=_bigger_pool(p)),
    "indices strides": lambda p: dict(indices=torch.zeros(*p.indices.shape[:2], 200, dtype=torch.int32)[..., :128]),
    "attn_sink added": lambda p: dict(attn_sink=torch.ones(p.q.shape[2])),
    "sm_scale": lambda p: dict(softmax_scale=0.03),
    "out strides": lambda p: dict(out=torch.empty(2, 2, 20, 512, dtype=torch.bfloat16)[:, :, :16]),
    "lse strides": lambda p: dict(lse=torch.empty(2, 2, 16).transpose(1, 2)),
    "outputs not given": lambda p: dict(out=None, lse=None),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change", CHANGES)
def test_a_changed_call_gets_a_new_replay(log, monkeypatch, backend, change):
    p = _problem(seed=3)
    out, lse = _outputs(p)
    meta, _ = flash_mla.get_mla_metadata()
    base = dict(q=p.q, k_cache=p.k_cache, out=out, lse=lse)

    def call(**kw):
        args = {**p.api_kwargs(), **base, **kw}
        return flash_mla.flash_mla_with_kvcache(args.pop("q"), args.pop("k_cache"), None, None, 512, meta,
                                                is_fp8_kvcache=True, backend=backend, **args)  # fmt: skip

    before, _ = _launches(log, call)
    old = _replay_of(meta)
    assert isinstance(old, launcher.Replay)
    changed = CHANGES[change](p)
    got, res = _launches(log, lambda: call(**changed))
    new = _replay_of(meta)
    assert isinstance(new, launcher.Replay) and new is not old
    want, res_want = _slow(log, lambda: call(**changed), monkeypatch)
    assert got == _with_outputs_of(res, want, res_want)
    assert (got == before) == (change == "k_cache dtype")  # the kernels take the cache's bytes either way
    again, res = _launches(log, lambda: call(**changed))  # replayed from the new recipe
    assert again == _with_outputs_of(res, want, res_want) and _replay_of(meta) is new


@pytest.mark.parametrize(
    "change",
    [
        dict(topk_length=None),
        dict(extra_k_cache="add"),
        dict(q="fewer heads"),
    ],
    ids=["topk_length dropped", "extra cache added", "h_q"],
)
def test_a_call_the_object_was_not_filled_for_is_refused_not_replayed(log, change):
    p = _problem(seed=4)
    meta, _ = flash_mla.get_mla_metadata()
    _call(p, meta, "hopper")
    assert isinstance(_replay_of(meta), launcher.Replay)
    kw = dict(change)
    if kw.get("extra_k_cache") == "add":
        e = _problem(seed=5, extra_topk=64)
        kw = dict(extra_k_cache=e.extra_k_cache, extra_indices_in_kvcache=e.extra_indices)
    q = p.q[:, :, :8] if kw.pop("q", None) else p.q
    log.clear()
    with pytest.raises(ValueError, match="filled for another configuration"):
        flash_mla.flash_mla_with_kvcache(
            q, p.k_cache, None, None, 512, meta, is_fp8_kvcache=True, backend="hopper", **{**p.api_kwargs(), **kw}
        )
    assert log == []


def test_each_scheduler_object_replays_its_own_plan(log, monkeypatch):
    p = _problem(seed=6)
    m1, _ = flash_mla.get_mla_metadata()
    m2, _ = flash_mla.get_mla_metadata(num_sms=20)
    first1, _ = _launches(log, lambda: _call(p, m1, "hopper"))
    first2, _ = _launches(log, lambda: _call(p, m2, "hopper"))
    assert first1[0][1] != first2[0][1]  # other partitions: another grid
    r1, r2 = _replay_of(m1), _replay_of(m2)
    assert isinstance(r1, launcher.Replay) and isinstance(r2, launcher.Replay) and r1 is not r2
    out, lse = _outputs(p)
    for meta in (m1, m2, m1):
        got, _ = _launches(log, lambda meta=meta: _call(p, meta, "hopper", out=out, lse=lse))
        want, _ = _slow(log, lambda meta=meta: _call(p, meta, "hopper", out=out, lse=lse), monkeypatch)
        assert got == want
        assert _pointers(got) >= {meta.table.metadata.data_ptr(), meta.plan.workspace[0].data_ptr()}


def test_a_launch_hook_or_the_switch_turns_the_replay_off(log, monkeypatch):
    from triton import knobs

    p = _problem(seed=7)
    meta, _ = flash_mla.get_mla_metadata()
    _call(p, meta, "hopper")
    replay = _replay_of(meta)
    runs = []
    real = launcher.Replay.run
    monkeypatch.setattr(launcher.Replay, "run", lambda self, t: runs.append(r := real(self, t)) or r)
    _call(p, meta, "hopper")
    assert runs == [True]

    def hook(*a, **k):
        return None

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        _call(p, meta, "hopper")
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert runs == [True, False]
    monkeypatch.setenv("SPARSE_MLA_DIRECT_LAUNCH", "0")
    _call(p, meta, "hopper")
    monkeypatch.delenv("SPARSE_MLA_DIRECT_LAUNCH")
    _call(p, meta, "hopper")
    assert runs == [True, False, False, True] and _replay_of(meta) is replay


def test_a_non_contiguous_topk_length_is_copied_per_call_and_the_copy_passed(log, monkeypatch):
    p = _problem(seed=8)
    meta, _ = flash_mla.get_mla_metadata()
    strided = torch.stack([p.topk_length, p.topk_length], dim=1)[:, 0]
    assert not strided.is_contiguous()
    _call(p, meta, "hopper", topk_length=strided)
    assert isinstance(_replay_of(meta), launcher.Replay)
    copies = []
    monkeypatch.setattr(
        ops, "dense_or_none", lambda t: None if t is None else copies.append(t.contiguous()) or copies[-1]
    )
    got, _ = _launches(log, lambda: _call(p, meta, "hopper", topk_length=strided))
    assert len(copies) == 1 and copies[0].data_ptr() in _pointers(got)


def test_one_tensor_in_two_places_is_not_replayed(log, monkeypatch):
    p = _problem(seed=9, extra_topk=64, extra_topk_length=[64, 10])
    p.extra_topk_length = p.topk_length  # the same tensor for both lengths: which place is which?
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = _outputs(p)
    first, _ = _launches(log, lambda: _call(p, meta, "hopper", out=out, lse=lse))
    assert _replay_of(meta) is False  # not tried again
    got, _ = _launches(log, lambda: _call(p, meta, "hopper", out=out, lse=lse))
    assert got == first


def test_the_reference_backend_records_nothing(log):
    p = _problem(seed=10)
    meta, _ = flash_mla.get_mla_metadata()
    _call(p, meta, "reference")
    assert log == [] and _replay_of(meta) is False


def test_the_replay_checks_pointer_alignment(log):
    p = _problem(seed=11)
    out, lse = _outputs(p)
    meta, _ = flash_mla.get_mla_metadata()
    _call(p, meta, "hopper", out=out, lse=lse)
    replay = _replay_of(meta)
    tensors = [p.q, p.k_cache, p.indices, p.topk_length, None, None, None, None, out, lse]
    log.clear()
    assert replay.run(tensors) and len(log) >= 1
    for i, t in enumerate(tensors):
        if t is None:
            continue
        flat = torch.zeros(t.numel() * t.element_size() + 16, dtype=torch.uint8)
        shifted = list(tensors)
        shifted[i] = flat[8 : 8 + t.numel() * t.element_size()].view(t.dtype).view(t.shape)  # 8 bytes off
        log.clear()
        assert not replay.run(shifted) and log == []


def test_make_replay_refuses_what_it_cannot_place(log):
    a, b, fixed = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    handle = type("Compiled", (), dict(run=None, function=None, packed_metadata=None))()
    ok = launcher.make_replay([(handle, (1, 1, 1), (a, (b, 3), fixed, 2.0))], [a, b], [fixed])
    assert ok is not None and [s[-1] for s in ok.steps] == [((0, -1, 0), (1, 0, 1))]
    stranger = torch.zeros(4)  # a per-call temporary: neither a call tensor nor a fixed one
    assert launcher.make_replay([(handle, (1, 1, 1), (a, stranger))], [a, b], [fixed]) is None
    assert launcher.make_replay([(handle, (1, 1, 1), (a,))], [a, a], [fixed]) is None  # which place?
    alias = a.view(torch.int32)  # another call tensor starting where a does: a view of one of them is unclear
    assert launcher.make_replay([(handle, (1, 1, 1), (a.view(torch.uint8),))], [a, alias], [fixed]) is None
    assert launcher.make_replay([(handle, (1, 1, 1), (a, ((b,),)))], [a, b], [fixed]) is None  # nested deeper
    assert launcher.make_replay([None], [a, b], [fixed]) is None
    assert launcher.make_replay([(handle, (1, 1, 1), (a.view(torch.int32),))], [a, b], [fixed]) is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(
    triton.__version__ not in launcher.DIRECT_LAUNCH_TRITON,
    reason="direct launches need a Triton release they were tested with",
)
@pytest.mark.parametrize("feature", FEATURES)
def test_replayed_kernels_give_the_normal_paths_results(monkeypatch, feature):
    p1 = _problem(seed=12, **FEATURES[feature]).to("cuda")
    p2 = _problem(seed=13, **FEATURES[feature]).to("cuda")
    meta, _ = flash_mla.get_mla_metadata()
    _call(p1, meta, "auto")
    assert isinstance(_replay_of(meta), launcher.Replay)
    runs = []
    real = launcher.Replay.run
    monkeypatch.setattr(launcher.Replay, "run", lambda self, t: runs.append(r := real(self, t)) or r)
    got = [t.clone() for t in _call(p2, meta, "auto")]
    assert runs == [True]
    monkeypatch.setenv("SPARSE_MLA_DIRECT_LAUNCH", "0")
    want = _call(p2, meta, "auto")
    assert runs == [True, False]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


class CudaLauncher:
    """Stands for Triton 3.6's compiled-kernel launcher: its ``__call__`` (recorded in ``wrapped``)
    adds the cooperative and PDL flags and the two scratch buffers (None without scratch) and
    forwards to the C entry ``launch`` (recorded in ``calls``)."""

    def __init__(self, scratch: int = 0, coop: bool = False, pdl: bool = True) -> None:
        self.calls, self.wrapped = [], []
        self.launch = lambda *a: self.calls.append(a)
        self.global_scratch_size = self.profile_scratch_size = scratch
        self.launch_cooperative_grid, self.launch_pdl = coop, pdl

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.wrapped.append(function)
        self.launch(
            gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, None, None, *args
        )


class CudaLauncher38(CudaLauncher):
    """Triton 3.8's wrapper names its metadata and hook arguments (and passes the C entry others)."""

    def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata, h0, h1, *args):
        self.wrapped.append(function)


CudaLauncher38.__name__ = "CudaLauncher"


def _replay_through(run, version="3.6.0"):
    """A two-launch replay through ``run`` (a nested tuple argument, a float, None and per-call
    pointers) under Triton ``version``, run once: the two per-call pointers."""
    import triton

    a, b = torch.zeros(4), torch.zeros(8)
    steps = tuple(
        (run, f"fn{k}", ("meta", k), (3, 1, 2), [0, (7, 0), 0.5, None, k], ((0, -1, 0), (1, 1, 1))) for k in range(2)
    )
    saved, triton.__version__ = triton.__version__, version
    try:
        fn = launcher._compile_steps(steps, ((0, a.data_ptr() & 15), (1, b.data_ptr() & 15)))
    finally:
        triton.__version__ = saved
    assert fn((a, b), 99) is True
    return a.data_ptr(), b.data_ptr()


def test_replay_calls_the_c_entry_with_the_wrappers_arguments():
    direct = CudaLauncher()
    pa, pb = _replay_through(direct)
    assert direct.wrapped == []  # the wrapper was skipped
    wrapped = CudaLauncher()
    for k in range(2):  # what the wrapper passes the C entry for the same launches
        wrapped(3, 1, 2, 99, f"fn{k}", ("meta", k), None, None, None, pa, (7, pb), 0.5, None, k)
    assert direct.calls == wrapped.calls and len(direct.calls) == 2
    assert direct.calls[0][5:9] == (False, True, None, None)


@pytest.mark.parametrize("case", ["scratch", "version", "signature"])
def test_replay_keeps_the_wrapper_when_it_does_more_than_forward(case):
    run = {"scratch": CudaLauncher(scratch=16), "version": CudaLauncher(), "signature": CudaLauncher38()}[case]
    _replay_through(run, version="3.8.0" if case == "version" else "3.6.0")
    assert run.wrapped == ["fn0", "fn1"]  # through the wrapper both times


def _shrunk(t):
    """A copy of ``t`` whose storage is then cut to half (the view's last elements outside it)."""
    c = t.clone()
    c.untyped_storage().resize_(c.untyped_storage().nbytes() // 2)
    return c


@pytest.mark.parametrize("repeated", [False, True])
@pytest.mark.parametrize("arg", ["k_cache", "q"])
def test_a_storage_shrunk_under_a_tensor_is_refused(log, arg, repeated):
    p = _problem(seed=12)
    meta, _ = flash_mla.get_mla_metadata()
    if repeated:  # the shortcut of a repeated call (same geometry) must not skip it
        _call(p, meta, "hopper")
    setattr(p, arg, _shrunk(getattr(p, arg)))
    log.clear()
    with pytest.raises(ValueError, match=f"^{arg}: .*storage"):
        _call(p, meta, "hopper")
    assert log == []


@pytest.mark.parametrize("repeated", [False, True])
@pytest.mark.parametrize(
    "make",
    [torch._neg_view, lambda q: q.to_sparse(), lambda q: torch._efficientzerotensor(q.shape, dtype=q.dtype)],
    ids=["negated view", "sparse", "zero tensor"],
)
def test_tensors_the_kernels_cannot_read_as_stored_are_refused(log, make, repeated):
    p = _problem(seed=13)
    meta, _ = flash_mla.get_mla_metadata()
    if repeated:
        _call(p, meta, "hopper")
    p.q = make(p.q)
    log.clear()
    with pytest.raises(ValueError, match="^q: "):
        _call(p, meta, "hopper")
    assert log == []


def test_scalars_of_other_types_are_validated_on_every_call(log, monkeypatch):
    class Dim(int):  # an == that always says yes must not pass for the validated value
        def __eq__(self, other):
            return True

        __hash__ = int.__hash__

    validated = []
    real = ops.validate_sparse_decode
    monkeypatch.setattr(ops, "validate_sparse_decode", lambda **kw: validated.append(1) or real(**kw))
    p = _problem(seed=14)
    meta, _ = flash_mla.get_mla_metadata()
    _call(p, meta, "hopper", softmax_scale=0.1)
    _call(p, meta, "hopper", softmax_scale=0.1)
    assert len(validated) == 1  # plain float: the repeated call takes the shortcut
    kw = {**p.api_kwargs(), "backend": "hopper"}
    flash_mla.flash_mla_with_kvcache(p.q, p.k_cache, None, None, Dim(512), meta, is_fp8_kvcache=True, **kw)
    assert len(validated) == 2
    with pytest.raises(ValueError, match="^head_dim_v: "):
        flash_mla.flash_mla_with_kvcache(p.q, p.k_cache, None, None, Dim(999), meta, is_fp8_kvcache=True, **kw)


@pytest.mark.parametrize("bad", ["bogus", None, 3])
def test_a_bad_backend_name_on_a_filled_object_is_named_as_such(log, bad):
    p = _problem(seed=15)
    meta, _ = flash_mla.get_mla_metadata()
    _call(p, meta, "hopper")
    with pytest.raises((ValueError, TypeError), match="^backend: expected"):
        _call(p, meta, bad)


def test_host_int_helpers_match_triton():
    # the launch paths' next_pow2 / cdiv (plain int math: Triton 3.6's are constexpr functions whose
    # wrapper costs several µs a call) give Triton's values, 0 included
    import triton

    from sparse_mla.core.env import cdiv, next_pow2

    for x in [0, 1, 2, 3, 4, 5, 63, 64, 65, 255, 256, 257, 2047, 2048, 32768, 32769, 2**31 - 1]:
        assert next_pow2(x) == triton.next_power_of_2(x), x
    for a in range(0, 70):
        for b in (1, 2, 3, 7, 16, 64):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
