"""Shared helpers of the test suite (random caches and problems, the FlashMLA tolerance check).

Import from a test file with ``from helpers import ...`` (``tests/conftest.py`` puts this folder
on ``sys.path``). Kernel tests reuse :func:`make_problem` and :func:`sparse_mla.testing.check_decode_close`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from sparse_mla.core.target import INTERPRETER, device_target
from sparse_mla.formats import get_layout, quantize_k_cache
from sparse_mla.testing import check_decode_close, cos_diff  # noqa: F401  (re-exported for the tests)

#: what the local GPU runs as (``SPARSE_MLA_TARGET`` makes an H100 choose as an A100); the
#: interpreter's target without a GPU
GPU_TARGET = device_target(torch.device("cuda")) if torch.cuda.is_available() else INTERPRETER
#: the Hopper (Gluon sm_90) kernels serve this GPU
ON_HOPPER = GPU_TARGET.hopper


#: what FlashMLA's dense decode test writes into the block-table entries past a request's length
GARBAGE_BLOCK = 2147480000


def triton_interpret_enabled() -> bool:
    """``TRITON_INTERPRET=1`` at start-up: ``triton.jit`` reads it when a kernel is *decorated*,
    so setting it inside a test is too late for a module already imported."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---------------------------------------------------------------- random inputs


def random_latent_k(
    num_blocks: int, page_block_size: int, d_qk: int, seed: int, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``[num_blocks, pbs, 1, d_qk]`` random latent vectors; every token and 64-value tile gets
    its own magnitude (10^-2 .. 10^0) so the caches use a spread of scales.

    Magnitudes stay O(1), like FlashMLA's test data: the kernels round P to bf16 before P·V (as
    FlashMLA does), and with values of ~10 an output entry that cancels to ~0.01 can miss the
    elementwise bound of FlashMLA's tolerances by bf16 rounding alone (an fp32 emulation of that rounding
    misses it too)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, page_block_size, 1, d_qk, generator=g)
    mag = 10.0 ** (torch.rand(num_blocks, page_block_size, 1, d_qk // 64, generator=g) * 2 - 2)
    k = k * mag.repeat_interleave(64, dim=-1)
    return k.to(dtype)


def make_cache(
    layout: str, num_blocks: int, page_block_size: int, seed: int, out_dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bf16 latent cache and its FP8 quantisation: ``(k_bf16, k_cache)``."""
    lay = get_layout(layout)
    k = random_latent_k(num_blocks, page_block_size, lay.d_qk, seed)
    return k, quantize_k_cache(k, lay, out_dtype=out_dtype)


def random_indices(
    b: int,
    s_q: int,
    topk: int,
    num_tokens: int,
    seed: int,
    invalid_frac: float = 0.1,
    exclude: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[b, s_q, topk]`` int32 cache indices: distinct valid tokens per query (like a top-k) with a
    fraction replaced by ``-1`` or out-of-range values (``num_tokens``, ``num_tokens + 7``, ...).

    ``exclude``: bool ``[num_tokens]`` of slots never to pick (e.g. slots filled with NaN).
    """
    g = torch.Generator().manual_seed(seed)
    allowed = torch.arange(num_tokens)
    if exclude is not None:
        allowed = allowed[~exclude]
    n = allowed.numel()
    out = torch.empty(b, s_q, topk, dtype=torch.int64)
    for i in range(b):
        for s in range(s_q):
            if n >= topk:
                pick = allowed[torch.randperm(n, generator=g)[:topk]]
            else:
                pick = allowed[torch.randint(0, n, (topk,), generator=g)]
            out[i, s] = pick
    r = torch.rand(b, s_q, topk, generator=g)
    bad = torch.randint(0, 3, (b, s_q, topk), generator=g)
    bad_val = torch.where(bad == 0, torch.full_like(out, -1), num_tokens + 7 * bad)
    out = torch.where(r < invalid_frac, bad_val, out)
    return out.to(torch.int32)


@dataclass
class Problem:
    """A random sparse decode problem (all arguments of the reference / the API)."""

    q: torch.Tensor
    k: torch.Tensor  # bf16 latent cache before quantisation
    k_cache: torch.Tensor
    indices: torch.Tensor
    layout: str
    topk_length: torch.Tensor | None = None
    attn_sink: torch.Tensor | None = None
    extra_k_cache: torch.Tensor | None = None
    extra_indices: torch.Tensor | None = None
    extra_topk_length: torch.Tensor | None = None

    def ref_kwargs(self) -> dict:
        return dict(
            topk_length=self.topk_length,
            attn_sink=self.attn_sink,
            extra_k_cache=self.extra_k_cache,
            extra_indices=self.extra_indices,
            extra_topk_length=self.extra_topk_length,
        )

    def to(self, device) -> Problem:
        """Move every tensor to ``device`` in place (caches keep their strides: :func:`cache_to`)."""
        for f in (
            "q",
            "k_cache",
            "indices",
            "topk_length",
            "attn_sink",
            "extra_k_cache",
            "extra_indices",
            "extra_topk_length",
        ):
            v = getattr(self, f)
            if v is not None:
                setattr(self, f, cache_to(v, device) if f.endswith("k_cache") else v.to(device))
        return self

    def api_kwargs(self) -> dict:
        return dict(
            indices=self.indices,
            topk_length=self.topk_length,
            attn_sink=self.attn_sink,
            extra_k_cache=self.extra_k_cache,
            extra_indices_in_kvcache=self.extra_indices,
            extra_topk_length=self.extra_topk_length,
        )


def make_problem(
    b: int = 2,
    s_q: int = 1,
    h_q: int = 16,
    topk: int = 128,
    layout: str = "V32",
    num_blocks: int = 6,
    page_block_size: int = 64,
    seed: int = 0,
    invalid_frac: float = 0.1,
    topk_length: list[int] | None = None,
    extra_topk: int = 0,
    extra_topk_length: list[int] | None = None,
    attn_sink: list[float] | None = None,
    out_dtype: torch.dtype = torch.float8_e4m3fn,
) -> Problem:
    """A random problem; ``attn_sink`` values are cycled over the heads."""
    lay = get_layout(layout)
    g = torch.Generator().manual_seed(seed + 1000)
    k, kc = make_cache(layout, num_blocks, page_block_size, seed, out_dtype)
    n_tok = num_blocks * page_block_size
    # q of a magnitude that gives a peaked but not one-hot softmax
    q = (torch.randn(b, s_q, h_q, lay.d_qk, generator=g) * 2.0).to(torch.bfloat16)
    idx = random_indices(b, s_q, topk, n_tok, seed + 1, invalid_frac)
    p = Problem(q=q, k=k, k_cache=kc, indices=idx, layout=layout)
    if topk_length is not None:
        p.topk_length = torch.tensor(topk_length, dtype=torch.int32)
    if extra_topk:
        _, ekc = make_cache(layout, 3, 32, seed + 2, out_dtype)
        p.extra_k_cache = ekc
        p.extra_indices = random_indices(b, s_q, extra_topk, 3 * 32, seed + 3, invalid_frac)
        if extra_topk_length is not None:
            p.extra_topk_length = torch.tensor(extra_topk_length, dtype=torch.int32)
    if attn_sink is not None:
        vals = [attn_sink[i % len(attn_sink)] for i in range(h_q)]
        p.attn_sink = torch.tensor(vals, dtype=torch.float32)
    return p


def cache_to(k_cache: torch.Tensor, device) -> torch.Tensor:
    """Move an FP8 cache to ``device`` keeping its strides.

    ``Tensor.to`` makes a dense copy, which drops the padding between MODEL1 blocks (their
    block stride exceeds ``page_block_size * 584``); copy the whole storage instead.
    """
    raw = k_cache.view(torch.uint8) if k_cache.dtype != torch.uint8 else k_cache
    n = raw.untyped_storage().nbytes()
    flat = torch.empty(0, dtype=torch.uint8, device=raw.device).set_(raw.untyped_storage(), 0, (n,), (1,))
    moved = flat.to(device).as_strided(raw.shape, raw.stride(), raw.storage_offset())
    return moved.view(k_cache.dtype) if k_cache.dtype != torch.uint8 else moved


def oracle64(p: Problem, sm_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse decode of ``p`` in float64, written out from the definition (independent of the
    library's references but for the dequantisation, exact in fp32): ``(out [b, s_q, h_q, 512],
    lse [b, h_q, s_q])`` float64 on the CPU; a query with no valid key gets out 0, lse +inf."""
    from sparse_mla.decode.reference import gather_kv

    q = p.q.double().cpu()
    d_qk = q.shape[-1]
    scale = d_qk**-0.5 if sm_scale is None else sm_scale
    k, valid = gather_kv(p.k_cache.cpu(), p.indices.cpu(), None if p.topk_length is None else p.topk_length.cpu())
    if p.extra_k_cache is not None:
        etl = None if p.extra_topk_length is None else p.extra_topk_length.cpu()
        ke, ve = gather_kv(p.extra_k_cache.cpu(), p.extra_indices.cpu(), etl)
        k, valid = torch.cat([k, ke], dim=2), torch.cat([valid, ve], dim=2)
    k = k.double()
    s = torch.einsum("bshd,bstd->bsht", q, k) * scale
    s = s.masked_fill(~valid.unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [b, s_q, h]
    w = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    out = torch.einsum("bsht,bstd->bshd", w, k[..., :512])
    if p.attn_sink is not None:
        sink = p.attn_sink.double().cpu()
        out = out * torch.sigmoid(lse - sink).unsqueeze(-1)
    lonely = torch.isneginf(lse)
    out = torch.where(lonely.unsqueeze(-1), 0.0, out)
    lse = torch.where(lonely, float("inf"), lse)
    return out, lse.transpose(1, 2)
