"""``backend=`` is resolved the same way for every operation (:mod:`sparse_mla.core.backend`): the
same names, the same errors, and ``SPARSE_MLA_BACKEND`` replacing ``"auto"`` wherever the operation
has a backend of that name."""

from __future__ import annotations

import pytest
import torch

import sparse_mla as flash_mla
from sparse_mla.core.backend import ALL_BACKEND_NAMES, BackendSet, check_backend_override
from sparse_mla.decode.backends import DECODE_BACKENDS
from sparse_mla.indexer.backends import INDEXER_BACKENDS
from sparse_mla.kvcache.backends import KVCACHE_BACKENDS
from sparse_mla.prefill.backends import PREFILL_BACKENDS

SETS = [DECODE_BACKENDS, PREFILL_BACKENDS, INDEXER_BACKENDS, KVCACHE_BACKENDS]
CPU = torch.device("cpu")


class _P:
    device = CPU


@pytest.mark.parametrize("bs", SETS, ids=lambda b: b.operation)
def test_every_operation_resolves_alike(bs: BackendSet, monkeypatch):
    monkeypatch.delenv("SPARSE_MLA_BACKEND", raising=False)
    assert set(bs.auto_order) <= set(ALL_BACKEND_NAMES)
    assert bs.auto_order[-1] == "reference"  # the twin serves everything, last
    assert bs.resolve(_P(), "reference").name == "reference"
    assert bs.resolve(_P(), "auto").unsupported(_P()) is None
    with pytest.raises(ValueError, match="^backend: expected 'auto' or one of"):
        bs.resolve(_P(), "bogus")
    with pytest.raises(TypeError, match="^backend: expected a str"):
        bs.resolve(_P(), 3)
    monkeypatch.setenv("SPARSE_MLA_BACKEND", "reference")
    assert bs.resolve(_P()).name == "reference"
    monkeypatch.setenv("SPARSE_MLA_BACKEND", "bogus")
    with pytest.raises(ValueError, match="^SPARSE_MLA_BACKEND: expected 'auto' or one of"):
        bs.resolve(_P())


def test_an_override_the_operation_lacks_leaves_auto(monkeypatch):
    monkeypatch.setenv("SPARSE_MLA_BACKEND", "hopper")  # the indexer and cache writes have none
    check_backend_override()
    assert INDEXER_BACKENDS.resolve(_P()).name == INDEXER_BACKENDS.resolve(_P(), "auto").name != "hopper"
    assert "hopper" not in KVCACHE_BACKENDS.by_name


def test_a_backend_that_cannot_serve_says_why(monkeypatch):
    monkeypatch.delenv("SPARSE_MLA_BACKEND", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # (read per call) CPU tensors without the interpreter
    for bs in SETS:
        with pytest.raises(ValueError, match=r"^backend: the 'portable' backend cannot serve this call: it runs CPU"):
            bs.resolve(_P(), "portable")
    with pytest.raises(
        ValueError,
        match=r"^backend: the 'hopper' backend cannot serve this call: it needs an sm_90 \(Hopper\) GPU, the tensors are on cpu$",
    ):
        DECODE_BACKENDS.resolve(_P(), "hopper")


def test_cache_writes_take_backend_and_agree(monkeypatch):
    monkeypatch.delenv("SPARSE_MLA_BACKEND", raising=False)
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(5, 576, generator=g).to(torch.bfloat16)
    slots = torch.tensor([0, 3, -1, 7, 9])
    caches = []
    for backend in ("auto", "reference"):
        cache = torch.zeros(2, 8, 1, 656, dtype=torch.uint8)
        flash_mla.quantize_and_store_kv(kv, slots, cache, backend=backend)
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])
    with pytest.raises(ValueError, match="^backend: expected 'auto' or one of"):
        flash_mla.quantize_and_store_kv(kv[:0], slots[:0], caches[0], backend="bogus")  # checked before n == 0
    abs_idx = torch.tensor([[[0, 5, 17, -1]]], dtype=torch.int32)
    table = torch.tensor([[2, 0, 1]], dtype=torch.int32)
    got = [flash_mla.abs_indices_to_kvcache_indices_triton(abs_idx, table, 8, backend=b) for b in ("auto", "reference")]
    assert torch.equal(got[0], got[1]) and torch.equal(
        got[1], flash_mla.abs_indices_to_kvcache_indices(abs_idx, table, 8)
    )
    with pytest.raises(ValueError, match="^backend: expected 'auto' or one of"):
        flash_mla.abs_indices_to_kvcache_indices_triton(abs_idx[:, :, :0], table, 8, backend="gluon-ish")


def test_indexer_calls_take_backend_and_agree(monkeypatch):
    monkeypatch.delenv("SPARSE_MLA_BACKEND", raising=False)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 40, generator=g)
    got = [flash_mla.topk_indices(logits, 8, backend=b) for b in ("auto", "reference")]
    assert torch.equal(got[0], got[1])
    table = torch.tensor([[1, 0], [0, 1]], dtype=torch.int32)
    slots = [flash_mla.topk_kvcache_indices(logits, 8, table, 32, next_n=2, backend=b) for b in ("auto", "reference")]
    assert torch.equal(slots[0], slots[1])
    k = torch.randn(6, 64, generator=g).to(torch.bfloat16)
    caches = []
    for b in ("auto", "reference"):
        cache = torch.zeros(2, 4, 1, 68, dtype=torch.uint8)
        flash_mla.indexer_k_quant_and_cache(k, cache, torch.tensor([0, 1, 2, 5, -1, 7]), backend=b)
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])
    q = torch.randn(3, 2, 64, generator=g).to(torch.float8_e4m3fn)
    keys = torch.randn(10, 64, generator=g).to(torch.float8_e4m3fn)
    scales, w = torch.rand(10, generator=g), torch.rand(3, 2, generator=g)
    ks, ke = torch.zeros(3, dtype=torch.int32), torch.tensor([4, 10, 7], dtype=torch.int32)
    out = [flash_mla.fp8_mqa_logits(q, (keys, scales), w, ks, ke, backend=b) for b in ("auto", "reference")]
    torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-5)
    for call in (
        lambda: flash_mla.topk_indices(logits[:0], 8, backend="bogus"),  # checked before the empty return
        lambda: flash_mla.indexer_k_quant_and_cache(k[:0], caches[0], torch.tensor([], dtype=torch.long), backend="x"),
        lambda: flash_mla.fp8_mqa_logits(q[:0], (keys, scales), w[:0], ks[:0], ke[:0], backend="bogus"),
    ):
        with pytest.raises(ValueError, match="^backend: expected 'auto' or one of"):
            call()


def test_an_empty_decode_checks_its_backend_too(monkeypatch):
    monkeypatch.delenv("SPARSE_MLA_BACKEND", raising=False)
    q = torch.zeros(0, 1, 16, 576, dtype=torch.bfloat16)
    cache = torch.zeros(1, 64, 1, 656, dtype=torch.uint8)
    idx = torch.zeros(0, 1, 8, dtype=torch.int32)
    for bad, err in (("bogus", ValueError), (None, TypeError), (3, TypeError)):
        meta, _ = flash_mla.get_mla_metadata()
        with pytest.raises(err, match="^backend: expected"):
            flash_mla.flash_mla_with_kvcache(
                q, cache, None, None, 512, meta, is_fp8_kvcache=True, indices=idx, backend=bad
            )
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(
        q, cache, None, None, 512, meta, is_fp8_kvcache=True, indices=idx, backend="reference"
    )
    assert out.shape == (0, 1, 16, 512) and lse.shape == (0, 16, 1)
    monkeypatch.setenv("SPARSE_MLA_BACKEND", "bogus")
    with pytest.raises(ValueError, match="^SPARSE_MLA_BACKEND: expected"):
        flash_mla.flash_mla_with_kvcache(q, cache, None, None, 512, meta, is_fp8_kvcache=True, indices=idx)


def test_a_backend_that_is_not_a_str_is_a_type_error():
    np = pytest.importorskip("numpy")
    for bs in SETS:
        with pytest.raises(TypeError, match="^backend: expected a str"):
            bs.resolve(_P(), np.array(["auto", "x"]))


def test_a_decode_backend_that_is_not_a_str_is_a_type_error(monkeypatch):
    np = pytest.importorskip("numpy")
    monkeypatch.delenv("SPARSE_MLA_BACKEND", raising=False)
    q = torch.zeros(1, 1, 16, 576, dtype=torch.bfloat16)
    cache = torch.zeros(1, 64, 1, 656, dtype=torch.uint8)
    idx = torch.zeros(1, 1, 8, dtype=torch.int32)
    meta, _ = flash_mla.get_mla_metadata()
    with pytest.raises(TypeError, match="^backend: expected a str"):
        flash_mla.flash_mla_with_kvcache(
            q, cache, None, None, 512, meta, is_fp8_kvcache=True, indices=idx, backend=np.array(["auto", "x"])
        )


def test_the_hopper_refusal_says_what_is_missing(monkeypatch):
    """Tensors on the CPU are named as such; a CUDA device under the interpreter is told that
    the interpreter is what stands in the way (not that a GPU is missing)."""
    from sparse_mla.core import backend

    monkeypatch.setattr(backend, "interpreting", lambda: False)
    assert backend.sm90_unsupported(CPU) == "needs an sm_90 (Hopper) GPU, the tensors are on cpu"
    monkeypatch.setattr(backend, "interpreting", lambda: True)
    assert backend.sm90_unsupported(torch.device("cuda", 0)) == "needs compiled kernels: TRITON_INTERPRET=1 is set"
