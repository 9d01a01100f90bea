"""The decode dispatcher (``sparse_mla.decode.backends``): backend choice and its reasons, the
``backend=`` argument and the ``SPARSE_MLA_BACKEND`` override, schedules sized for the chosen
backend's tile, and ``torch.compile`` of a caller of ``flash_mla_with_kvcache`` with nothing but
``import sparse_mla``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import ON_HOPPER, cache_to, check_decode_close, make_problem

import sparse_mla as flash_mla
from sparse_mla.decode import AUTO_ORDER, BACKENDS, backend_support, get_backend, resolve_backend
from sparse_mla.decode.problem import validate_sparse_decode
from sparse_mla.decode.scheduler import compute_num_sm_parts
from sparse_mla.reference import sparse_decode_reference

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
KERNELS = ON_GPU or os.environ.get("TRITON_INTERPRET", "0") == "1"
HOPPER = ON_HOPPER
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def problem(layout="V32", h_q=16, seed=0, **kw):
    p = make_problem(b=2, s_q=1, h_q=h_q, topk=96, layout=layout, num_blocks=3, seed=seed, **kw)
    for f in ("q", "indices"):
        setattr(p, f, getattr(p, f).to(DEVICE))
    p.k_cache = cache_to(p.k_cache, DEVICE)
    return p


def call(p, meta=None, **kw):
    meta = meta or flash_mla.get_mla_metadata()[0]
    out, lse = flash_mla.flash_mla_with_kvcache(
        p.q, p.k_cache, None, None, 512, meta, is_fp8_kvcache=True, indices=p.indices, **kw
    )
    return out, lse, meta


def test_registry():
    assert set(BACKENDS) == set(AUTO_ORDER) == {"hopper", "portable", "reference"}
    assert get_backend("reference") is BACKENDS["reference"]
    assert get_backend("tl") is BACKENDS["portable"] and get_backend("gluon") is BACKENDS["hopper"]  # old names
    with pytest.raises(ValueError, match="^backend: expected 'auto' or one of"):
        get_backend("cuda")
    with pytest.raises(TypeError, match="^backend"):
        get_backend(None)


def test_auto_picks_the_first_that_serves(monkeypatch):
    p = problem()
    dp = validate_sparse_decode(q=p.q, k_cache=p.k_cache, indices=p.indices)
    support = backend_support(dp)
    assert list(support) == list(AUTO_ORDER) and support["reference"] is None
    want = next(n for n in AUTO_ORDER if support[n] is None)
    assert resolve_backend(dp).name == want
    if HOPPER:
        assert want == "hopper"
    elif KERNELS:
        assert want == "portable" and "sm_90" in support["hopper"]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not ON_GPU:  # CPU tensors without the interpreter: only the reference serves them
        support = backend_support(dp)
        assert "TRITON_INTERPRET=1" in support["portable"] and support["hopper"].startswith("needs an sm_90")
        assert resolve_backend(dp).name == "reference"


@pytest.mark.skipif(ON_GPU, reason="CPU tensors")
def test_unavailable_backend_says_why(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    p = problem()
    with pytest.raises(
        ValueError, match=r"^backend: the 'portable' backend cannot serve this call: it runs CPU tensors only"
    ):
        call(p, backend="portable")
    with pytest.raises(
        ValueError,
        match=r"^backend: the 'hopper' backend cannot serve this call: it needs an sm_90 \(Hopper\) GPU, the tensors are on cpu$",
    ):
        call(p, backend="hopper")
    with pytest.raises(ValueError, match="^backend: expected 'auto' or one of"):
        call(p, backend="fast")


@pytest.mark.parametrize("layout", ["V32", "MODEL1"])
def test_every_serving_backend_matches_the_reference(layout):
    p = problem(layout, h_q=20, seed=3, topk_length=[60, 96], attn_sink=[0.3, -1.0])
    ro, rl = sparse_decode_reference(
        p.q,
        p.k_cache,
        p.indices,
        None,
        512,
        **{k: (v.to(DEVICE) if v is not None else v) for k, v in p.ref_kwargs().items()},
    )
    dp = validate_sparse_decode(q=p.q, k_cache=p.k_cache, indices=p.indices)
    ran = []
    for name, why_not in backend_support(dp).items():
        if why_not is not None:
            continue
        out, lse, meta = call(p, topk_length=p.topk_length.to(DEVICE), attn_sink=p.attn_sink.to(DEVICE), backend=name)
        assert meta.backend == name
        check_decode_close(out, lse, ro, rl)
        ran.append(name)
    assert "reference" in ran and (not KERNELS or "portable" in ran) and (not HOPPER or "hopper" in ran)


@pytest.mark.parametrize("h_q", [8, 16, 40, 128])
def test_schedule_is_sized_for_the_backend_tile(h_q):
    p = problem(h_q=h_q)
    for name in ("reference",) + (("portable",) if KERNELS else ()) + (("hopper",) if HOPPER else ()):
        _, _, meta = call(p, meta=flash_mla.get_mla_metadata(num_sms=64)[0], backend=name)
        tile = BACKENDS[name].heads_per_cta(h_q)
        assert meta.table.num_sm_parts == compute_num_sm_parts(64, 1, h_q, tile)


def test_backend_is_fixed_by_the_first_call(monkeypatch):
    p = problem()
    meta = flash_mla.get_mla_metadata()[0]
    call(p, meta, backend="reference")
    call(p, meta, backend="reference")
    with pytest.raises(ValueError, match=r"^tile_scheduler_metadata: .*backend 'reference' -> 'auto'"):
        call(p, meta)


def test_environment_override_replaces_auto_only(monkeypatch):
    p = problem()
    monkeypatch.setenv("SPARSE_MLA_BACKEND", "reference")
    assert call(p)[2].backend == "reference"
    if KERNELS:
        assert call(p, backend="portable")[2].backend == "portable"  # an explicit choice wins
    monkeypatch.setenv("SPARSE_MLA_BACKEND", "bogus")
    with pytest.raises(ValueError, match="^SPARSE_MLA_BACKEND: expected 'auto' or one of"):
        call(p)
    monkeypatch.setenv("SPARSE_MLA_BACKEND", "auto")
    call(p)


def test_torch_compile_fullgraph_with_only_import_sparse_mla():
    """A module calling flash_mla_with_kvcache compiles without graph breaks (fresh interpreter:
    nothing but ``import sparse_mla``), with the result of the eager call."""
    code = f"""
import sys, torch
import sparse_mla as flash_mla
sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
from helpers import cache_to, make_problem
dev = {DEVICE!r}
p = make_problem(b=2, s_q=1, h_q=16, topk=64, seed=3, topk_length=[50, 64], attn_sink=[0.5])
q, kc, idx, lens, sink = p.q.to(dev), cache_to(p.k_cache, dev), p.indices.to(dev), p.topk_length.to(dev), p.attn_sink.to(dev)
meta, _ = flash_mla.get_mla_metadata(num_sms=8)

def step(q, kc, idx, lens, sink):
    out, lse = flash_mla.flash_mla_with_kvcache(q, kc, None, None, 512, meta, is_fp8_kvcache=True, indices=idx,
                                                topk_length=lens, attn_sink=sink)
    return out.float() * 2, lse

oe, le = step(q, kc, idx, lens, sink)  # fills the scheduler object
oc, lc = torch.compile(step, fullgraph=True, backend={"inductor" if ON_GPU else "aot_eager"!r})(q, kc, idx, lens, sink)
assert torch.equal(oe, oc) and torch.equal(le, lc), "compiled != eager"
assert "sparse_mla.library" not in sys.modules
print("OK", meta.backend)
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert r.stdout.startswith("OK")
