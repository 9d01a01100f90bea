"""The dense MLA decode (``flash_mla_with_kvcache`` without ``indices``): the portable kernel
against its PyTorch twin, the twin against a float64 oracle written here, and the contract's edges.

Every request attends the positions ``0 .. cache_seqlens[i] - 1`` of its context through its
block-table row (``causal``: query token ``j`` of ``s_q`` those below ``len - s_q + j + 1``). The
caches are built as FlashMLA's dense test builds them: the blocks a request uses are a random
permutation, the block-table entries past its length hold garbage (2147480000) and every slot
nobody attends holds NaN. Small shapes: on a machine without a GPU the kernels run in Triton's
interpreter.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import pytest
import torch
from cache_bytes import poison_slots
from helpers import GARBAGE_BLOCK, random_latent_k

import sparse_mla as flash_mla
from sparse_mla.decode.backends import backend_support
from sparse_mla.decode.problem import validate_dense_decode
from sparse_mla.decode.reference import dense_decode_reference
from sparse_mla.testing import FLASHMLA_DENSE_DECODE as DENSE
from sparse_mla.testing import Tolerance, check_decode_close

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
pytestmark = pytest.mark.skipif(
    not ON_GPU and os.environ.get("TRITON_INTERPRET", "0") != "1",
    reason="kernels need a GPU or TRITON_INTERPRET=1 (set before starting pytest)",
)


def tol_for(d: Dense) -> Tolerance:
    """FlashMLA's dense tolerances, with the elementwise out bound widened by what rounding P to
    bf16 before P·V may cost (as FlashMLA's kernel rounds it): ``|Δout| <= 2^-9 · max|v|``.
    FlashMLA's test data (values ~0.1, contexts of hundreds of tokens) stays far inside 8e-4; these
    tests use values up to ~4 and contexts of a few tokens, where one rounded weight shows. The
    cosine bound is FlashMLA's."""
    k = flash_mla.dequantize_k_cache(d.clean, "V32" if d.q.shape[-1] == 576 else "MODEL1") if d.fp8 else d.clean
    v = k[..., :512].float()
    vmax = float(v[v.isfinite()].abs().max()) if v.numel() else 0.0
    return dataclasses.replace(DENSE, out_abs=DENSE.out_abs + 2.0**-9 * vmax)


@dataclass
class Dense:
    q: torch.Tensor
    k_cache: torch.Tensor  # NaN in every slot nobody attends
    clean: torch.Tensor  # the same cache without the NaN
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    causal: bool
    fp8: bool

    def call(self, num_sms=8, meta=None, **kw):
        meta = meta or flash_mla.get_mla_metadata(num_sms=num_sms)[0]
        out, lse = flash_mla.flash_mla_with_kvcache(
            self.q, self.k_cache, self.block_table, self.cache_seqlens, 512, meta, causal=self.causal,
            is_fp8_kvcache=self.fp8, **kw,
        )  # fmt: skip
        return out, lse, meta

    def twin(self, dtype=torch.float32):
        return dense_decode_reference(
            self.q.cpu(), self.clean, self.block_table.cpu(), self.cache_seqlens.cpu(), causal=self.causal, dtype=dtype
        )


def make_dense(
    lens, s_q=1, h_q=16, d_qk=576, pbs=16, dtype=torch.bfloat16, fp8=False, causal=False, seed=0, spare=2
) -> Dense:
    """A random dense problem with contexts ``lens`` (one column of garbage past the longest)."""
    b = len(lens)
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(1, -(-max(lens, default=0) // pbs)) + 1
    nb = b * max_blocks + spare
    k = random_latent_k(nb, pbs, d_qk, seed, torch.bfloat16 if fp8 else dtype)
    perm = torch.randperm(nb, generator=g)[: b * max_blocks].view(b, max_blocks).to(torch.int32)
    table = perm.clone()
    attended = torch.zeros(nb * pbs, dtype=torch.bool)
    for i, n in enumerate(lens):
        table[i, -(-n // pbs) :] = GARBAGE_BLOCK
        t = torch.arange(n)
        attended[perm[i, t // pbs].long() * pbs + t % pbs] = True
    q = (torch.randn(b, s_q, h_q, d_qk, generator=g) * 0.5).to(dtype)
    if fp8:
        clean = flash_mla.quantize_k_cache(k, "V32" if d_qk == 576 else "MODEL1")
        kc = clean.clone()
        poison_slots(kc, (~attended).nonzero().flatten())
    else:
        clean = k
        kc = k.clone()
        kc.view(-1, d_qk)[~attended] = float("nan")
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return Dense(q.to(DEVICE), kc.to(DEVICE), clean, table.to(DEVICE), lens_t.to(DEVICE), causal, fp8)


def check(d: Dense, num_sms=8, **kw):
    out, lse, meta = d.call(num_sms, **kw)
    b, s_q, h_q, _ = d.q.shape
    assert out.dtype == d.q.dtype and lse.dtype == torch.float32
    assert out.shape == (b, s_q, h_q, 512) and lse.shape == (b, h_q, s_q)
    ro, rl = d.twin()
    check_decode_close(out, lse, ro, rl, tol=tol_for(d))
    return out, lse, meta


# ------------------------------------------------------------------ kernel against the twin


@pytest.mark.parametrize(
    "lens, s_q, h_q, d_qk, dtype",
    [
        ([37, 0, 5], 1, 16, 576, torch.bfloat16),
        ([64, 20], 2, 16, 512, torch.bfloat16),
        ([50, 17], 1, 1, 576, torch.float16),
        ([33, 0], 2, 64, 512, torch.float16),
        ([40], 1, 128, 576, torch.bfloat16),
        ([70, 3], 1, 20, 576, torch.bfloat16),
    ],
)
def test_matches_twin(lens, s_q, h_q, d_qk, dtype):
    check(make_dense(lens, s_q, h_q, d_qk, dtype=dtype, seed=h_q + s_q))


@pytest.mark.parametrize("lens, s_q", [([40, 2, 0], 2), ([19, 64], 3), ([4, 0, 30], 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_causal(lens, s_q, dtype):
    d = make_dense(lens, s_q, 16, 576, dtype=dtype, causal=True, seed=s_q)
    out, lse, _ = check(d)
    # token j of a request of length n attends n - s_q + j + 1 positions: the last one all of them
    full = make_dense(lens, s_q, 16, 576, dtype=dtype, causal=False, seed=s_q)
    out_full, lse_full, _ = full.call()
    torch.testing.assert_close(out[:, -1], out_full[:, -1], rtol=0, atol=0)
    torch.testing.assert_close(lse[:, :, -1], lse_full[:, :, -1], rtol=0, atol=0)


@pytest.mark.parametrize("pbs", [64, 16, 61, 1, 100, 128])
def test_page_block_sizes(pbs):
    """Pages below 64 tokens (a division per position) and of 64 or more (a step spans one block or
    two: 100 and 128 cross page boundaries inside a 64-token step)."""
    check(make_dense([275, 1, 0], 1, 16, 576, pbs=pbs, seed=pbs))


@pytest.mark.parametrize(
    "layout, causal, pbs", [("V32", False, 61), ("MODEL1", True, 64), ("V32", True, 64), ("V32", False, 100), ("MODEL1", False, 128)]
)  # fmt: skip
def test_fp8_caches(layout, causal, pbs):
    d = make_dense([170, 0, 9], 2, 16, 576 if layout == "V32" else 512, pbs=pbs, fp8=True, causal=causal, seed=3)
    check(d)


def test_split_requests_are_combined():
    """Many partitions for few requests: the long ones are split and the combine kernel merges them."""
    d = make_dense([150, 6], 1, 16, 576, pbs=64, seed=7)
    _, _, meta = check(d, num_sms=132)
    ns = meta.num_splits.tolist()
    assert ns[1] - ns[0] > 1


def test_nan_in_unattended_slots_never_leaks():
    d = make_dense([45, 0, 17], 2, 16, 576, pbs=16, causal=True, seed=11)
    # the caller's table may also point past the cache for blocks it does not use
    assert (d.block_table == GARBAGE_BLOCK).any() and torch.isnan(d.k_cache.float()).any()
    out, lse, _ = check(d)
    assert torch.isfinite(out.float()).all()
    assert torch.isposinf(lse[1]).all() and (out[1].float() == 0).all()  # the empty context


def test_zero_contexts_and_empty_batch():
    d = make_dense([0, 0], 2, 16, 512)
    out, lse, meta = check(d)
    assert (out.float() == 0).all() and torch.isposinf(lse).all()
    e = make_dense([0, 0], 1, 16, 576)
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(e.q[:0], e.k_cache, e.block_table[:0], e.cache_seqlens[:0], 512, meta)
    assert out.shape == (0, 1, 16, 512) and out.dtype == e.q.dtype and lse.shape == (0, 16, 1)
    assert not meta.have_initialized  # an empty step launches nothing


def test_out_and_lse_buffers():
    d = make_dense([30, 8], 2, 16, 576, dtype=torch.float16, seed=5)
    out = torch.full((2, 2, 16, 512), 7.0, dtype=torch.float16, device=DEVICE)
    lse = torch.full((2, 16, 2), 7.0, device=DEVICE)
    o, lo, _ = d.call(out=out, lse=lse)
    assert o is out and lo is lse
    ro, rl = d.twin()
    check_decode_close(out, lse, ro, rl, tol=tol_for(d))


def test_reused_scheduler_object_follows_new_lengths():
    """A scheduler object filled by one step serves the next with other lengths (the schedule is
    made from cache_seqlens by every call); on the CPU a repeated call checks the lengths too."""
    d = make_dense([40, 20], 1, 16, 576, seed=2)
    _, _, meta = check(d, num_sms=16)
    d.cache_seqlens = torch.tensor([3, 41], dtype=torch.int32, device=DEVICE)
    d.block_table = d.block_table.clone()
    d.block_table[1, :3] = torch.tensor([0, 1, 2], dtype=torch.int32)
    d.k_cache = d.clean.to(DEVICE)
    out, lse, _ = d.call(meta=meta)
    check_decode_close(out, lse, *d.twin(), tol=tol_for(d))
    if DEVICE == "cpu":
        d.cache_seqlens = torch.tensor([3, -1], dtype=torch.int32)
        with pytest.raises(ValueError, match="^cache_seqlens: expected lengths >= 0"):
            d.call(meta=meta)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_graph_replay_follows_new_lengths():
    """A captured dense call replays with the lengths and block table its buffers hold at replay
    (the schedule is made on the device inside the graph)."""
    d = make_dense([200, 37, 64], 2, 16, 576, pbs=64, causal=True, seed=5)
    d.k_cache = d.clean.to(DEVICE)  # every slot finite: the block table changes below
    out, lse, meta = check(d, num_sms=16)  # fills the scheduler object
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse, _ = d.call(meta=meta)
    for lens in ([200, 37, 64], [5, 130, 2], [0, 64, 199]):
        d.cache_seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        torch.manual_seed(len(lens) + lens[0])
        d.block_table.copy_(torch.randperm(d.clean.shape[0])[: d.block_table.numel()].view_as(d.block_table))
        graph.replay()
        torch.cuda.synchronize()
        check_decode_close(g_out, g_lse, *d.twin(), tol=tol_for(d))


def test_strides_past_int32_offsets():
    """Views whose s_q stride takes an offset past 2^31 elements (q read, lse written) address
    right: the kernels' offsets are int64. (The buffers are virtual: only the viewed elements are
    touched.)"""
    big = 2**30 + 64
    d = make_dense([40], 1, 1, 576, seed=11)
    d.k_cache = d.clean.to(DEVICE)
    q3 = torch.cat([d.q] * 3, dim=1)  # s_q 3
    buf = torch.empty(2 * big + 576, dtype=q3.dtype, device=DEVICE)
    q = buf.as_strided((1, 3, 1, 576), (3 * big, big, 576, 1))
    q.copy_(q3)
    d.q = q
    lse = torch.empty(2 * big + 8, device=DEVICE).as_strided((1, 1, 3), (3 * big, 3 * big, big))
    out, got_lse, _ = d.call(lse=lse)
    want_out, want_lse = d.twin()
    check_decode_close(out, got_lse, want_out, want_lse, tol=tol_for(d))
    assert torch.equal(got_lse.cpu(), lse.cpu())


def test_more_slots_than_int32_are_refused():
    """A cache (or an expanded view) of more than 2^31 - 1 token slots: refused, not read as empty."""
    d = make_dense([64], 1, 4, 576, pbs=64, seed=12)
    d.k_cache = d.clean[:1].to(DEVICE).expand(2**26, -1, -1, -1)  # 2^32 slots
    with pytest.raises(ValueError, match="^k_cache: .* token slots"):
        d.call()


def test_reference_backend_and_hopper_refusal():
    d = make_dense([25, 4], 2, 16, 576, causal=True, seed=9)
    out, lse, meta = d.call(backend="reference")
    assert meta.backend == "reference"
    check_decode_close(out, lse, *d.twin(), tol=tol_for(d))
    out, lse, meta = d.call()
    assert meta.backend == "portable"
    with pytest.raises(ValueError, match="^backend: the 'hopper' backend cannot serve this call: it serves the sparse"):
        d.call(backend="hopper")
    p = validate_dense_decode(q=d.q, k_cache=d.k_cache, block_table=d.block_table, cache_seqlens=d.cache_seqlens)
    assert "the 'portable' backend serves the dense decode" in backend_support(p)["hopper"]


def test_torch_op():
    d = make_dense([33, 12], 2, 16, 512, causal=True, seed=4)
    _, _, meta = check(d)
    out, lse = torch.ops.sparse_mla.dense_decode(
        d.q, d.k_cache, d.block_table, d.cache_seqlens, meta.tile_scheduler_metadata, 512**-0.5, causal=True
    )
    check_decode_close(out, lse, *d.twin(), tol=tol_for(d))
    # the eager entry through the op (what a caller of the op with a filled scheduler object runs)
    from sparse_mla.decode.eager import decode

    out2, lse2 = decode(d.q, d.k_cache, None, meta, block_table=d.block_table, cache_seqlens=d.cache_seqlens,
                        is_fp8_kvcache=False, causal=True, through_op=True)  # fmt: skip
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    if ON_GPU:  # the op reads no values on the GPU (no host synchronisation inside a compiled graph)
        return
    with pytest.raises(ValueError, match="^cache_seqlens: with causal=True"):
        torch.ops.sparse_mla.dense_decode(
            d.q, d.k_cache, d.block_table, d.cache_seqlens.clamp(max=1), meta.tile_scheduler_metadata, 0.1, causal=True
        )


def test_compiled_call():
    d = make_dense([20, 9], 1, 16, 576, seed=6)
    meta = flash_mla.get_mla_metadata(num_sms=8)[0]
    want, want_lse, _ = d.call(meta=meta)  # fills the scheduler object (torch.compile cannot)

    def step(q, kc, table, lens):
        return flash_mla.flash_mla_with_kvcache(q, kc, table, lens, 512, meta)

    torch._dynamo.reset()
    out, lse = torch.compile(step, fullgraph=True, backend="eager")(d.q, d.k_cache, d.block_table, d.cache_seqlens)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


# ------------------------------------------------------------------ the twin against float64


def oracle64(d: Dense) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense decode written out per request and query token in float64 (FlashMLA's reference
    formula): the context rows through the block table, the causal limit, softmax, P·V."""
    q = d.q.cpu().double()
    b, s_q, h_q, d_qk = q.shape
    kc = d.clean
    if d.fp8:
        kc = flash_mla.dequantize_k_cache(kc, "V32" if d_qk == 576 else "MODEL1")
    kc = kc.double()
    pbs = kc.shape[1]
    out = torch.zeros(b, s_q, h_q, 512, dtype=torch.float64)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float64)
    for i in range(b):
        n = int(d.cache_seqlens[i])
        rows = torch.stack([kc[int(d.block_table[i, t // pbs]), t % pbs, 0] for t in range(n)]) if n else None
        for j in range(s_q):
            m = n - s_q + j + 1 if d.causal else n
            if m <= 0:
                continue
            s = q[i, j] @ rows[:m].T * d_qk**-0.5  # [h_q, m]
            lse[i, :, j] = torch.logsumexp(s, dim=-1)
            out[i, j] = torch.softmax(s, dim=-1) @ rows[:m, :512]
    return out, lse


@pytest.mark.parametrize("fp8, causal", [(False, False), (False, True), (True, True)])
def test_twin_matches_float64_oracle(fp8, causal):
    d = make_dense([21, 0, 40], 3, 4, 576, pbs=16, fp8=fp8, causal=causal, seed=13)
    ro, rl = d.twin()
    oo, ol = oracle64(d)
    torch.testing.assert_close(ro.double(), oo, rtol=1e-5, atol=1e-6)
    assert torch.equal(torch.isposinf(rl), torch.isposinf(ol))
    fin = torch.isfinite(ol)
    torch.testing.assert_close(rl.double()[fin], ol[fin], rtol=1e-6, atol=1e-6)
    o64, l64 = d.twin(torch.float64)
    torch.testing.assert_close(o64, oo, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(l64[fin], ol[fin], rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ validation


def _args(d: Dense) -> dict:
    return dict(q=d.q, k_cache=d.k_cache, block_table=d.block_table, cache_seqlens=d.cache_seqlens, head_dim_v=512,
                causal=d.causal, is_fp8_kvcache=d.fp8)  # fmt: skip


def _bad_cases(d: Dense, fp8: Dense) -> list:
    q, kc, bt, lens = d.q, d.k_cache, d.block_table, d.cache_seqlens
    i32 = torch.int32
    return [
        (dict(q=q.float()), TypeError, "^q: expected dtype torch.bfloat16 or torch.float16"),
        (dict(q=q[0]), ValueError, "^q: expected a 4-D tensor"),
        (dict(q=torch.zeros(2, 2, 129, 576, dtype=q.dtype, device=DEVICE)), ValueError, "^q: h_q must be <= 128"),
        (dict(q=q[..., :256]), ValueError, "^q: head dim d_qk must be 576"),
        (dict(k_cache=kc.half()), TypeError, r"^k_cache: expected dtype torch.bfloat16 \(q's dtype"),
        (dict(k_cache=fp8.k_cache), TypeError, "^k_cache: an FP8 cache"),
        (dict(k_cache=kc.expand(-1, -1, 2, -1)), ValueError, "^k_cache: h_kv"),
        (dict(k_cache=kc[..., :512]), ValueError, r"^k_cache: expected head dim 576"),
        (dict(k_cache=torch.zeros(*kc.shape[:3], 1152, dtype=kc.dtype, device=DEVICE)[..., ::2]), ValueError,
         "^k_cache: the last dimension must be contiguous"),
        (dict(is_fp8_kvcache=True), TypeError, "^k_cache"),
        (dict(q=q.half(), k_cache=fp8.k_cache, is_fp8_kvcache=True), TypeError, "^q: the FP8 cache"),
        (dict(block_table=bt.long()), TypeError, "^block_table: expected an int32 tensor"),
        (dict(block_table=None), TypeError, "^block_table: expected an int32 tensor"),
        (dict(block_table=bt[0]), ValueError, "^block_table: expected a 2-D tensor"),
        (dict(block_table=bt[:1]), ValueError, r"^block_table: expected shape \[b=2"),
        (dict(block_table=bt.clone().fill_(-1)), ValueError, r"^block_table: entry \[0, 0\] = -1 is used by"),
        (dict(block_table=bt.clone().fill_(10**6)), ValueError, r"^block_table: entry \[0, 0\] = 1000000"),
        (dict(cache_seqlens=None), TypeError, "^cache_seqlens: expected an int32 tensor"),
        (dict(cache_seqlens=lens.long()), TypeError, "^cache_seqlens: expected dtype torch.int32"),
        (dict(cache_seqlens=lens[:1]), ValueError, r"^cache_seqlens: expected shape \[b=2\]"),
        (dict(cache_seqlens=torch.tensor([-1, 3], dtype=i32, device=DEVICE)), ValueError, "^cache_seqlens: expected lengths >= 0"),
        (dict(cache_seqlens=lens + 1000), ValueError, "^cache_seqlens: a length of .* more than block_table holds"),
        (dict(cache_seqlens=torch.tensor([1, 3], dtype=i32, device=DEVICE), causal=True), ValueError,
         "^cache_seqlens: with causal=True each length must be 0 or at least s_q=2"),
        (dict(head_dim_v=576), ValueError, "^head_dim_v: expected 512"),
        (dict(causal=1), TypeError, "^causal: expected a bool"),
        (dict(softmax_scale=-1.0), ValueError, "^softmax_scale"),
        (dict(attn_sink=torch.zeros(16, device=DEVICE)), ValueError, "^attn_sink: only the sparse decode"),
        (dict(topk_length=lens), ValueError, "^topk_length: only the sparse decode"),
        (dict(out=torch.empty(2, 2, 16, 512, device=DEVICE)), TypeError, "^out: expected dtype torch.bfloat16"),
        (dict(out=torch.empty(2, 1, 16, 512, dtype=q.dtype, device=DEVICE)), ValueError, "^out: expected shape"),
        (dict(lse=torch.empty(2, 2, 16, device=DEVICE)), ValueError, "^lse: expected shape"),
    ]  # fmt: skip


def test_validation_errors_name_the_argument():
    d = make_dense([20, 5], 2, 16, 576)
    fp8 = make_dense([20, 5], 2, 16, 576, fp8=True)
    for change, exc, pattern in _bad_cases(d, fp8):
        kw = {**_args(d), **change}
        meta, _ = flash_mla.get_mla_metadata(num_sms=8)
        with pytest.raises(exc, match=pattern):
            flash_mla.flash_mla_with_kvcache(
                kw.pop("q"), kw.pop("k_cache"), kw.pop("block_table"), kw.pop("cache_seqlens"), kw.pop("head_dim_v"),
                meta, **kw,
            )  # fmt: skip
        assert not meta.have_initialized
    meta, _ = flash_mla.get_mla_metadata()
    with pytest.raises(ValueError, match="^num_splits: must be None"):
        flash_mla.flash_mla_with_kvcache(d.q, d.k_cache, d.block_table, d.cache_seqlens, 512, meta, num_splits=1)


def test_a_dense_scheduler_object_refuses_a_sparse_call():
    d = make_dense([20, 5], 1, 16, 576, fp8=True)
    _, _, meta = d.call()
    idx = torch.zeros(2, 1, 64, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="^tile_scheduler_metadata: this object was filled for another configuration"):
        flash_mla.flash_mla_with_kvcache(d.q, d.k_cache, None, None, 512, meta, is_fp8_kvcache=True, indices=idx)
