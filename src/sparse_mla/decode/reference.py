"""fp32 PyTorch reference of the MLA decode, sparse (FP8 cache, top-k indices) and dense (every
context position through a block table): the test oracle; docs/design.md §3, walkthrough steps 5-16.

Two references of the same function:

* :func:`sparse_decode_reference` — the direct definition: gather the top-k tokens of the cache
  (and of the extra cache), dequantise, softmax over the valid ones, weight v.
* :func:`sparse_decode_split_reference` — the split-KV path exactly as the kernels run it:
  partitions from the tile scheduler, per-partition partial O with log2-space LSE, then
  :func:`combine_reference`. Agreement of the two is a test of the scheduler and the combine.

Semantics (FlashMLA 1.0): an index is valid iff ``0 <= idx < num_blocks * page_block_size`` and
its position is below ``topk_length[i]``; invalid keys get weight 0 and their cache bytes are
never used (NaN there cannot leak); a query with no valid key gets out = 0 and lse = +inf;
``attn_sink[h]`` scales the output by ``exp(lse) / (exp(lse) + exp(sink))`` and leaves lse alone.
Non-finite values (the same on every path): a valid key with a NaN or ``+inf`` score makes the
query head's out and lse NaN, a ``-inf`` score gives its key weight 0, a NaN sink makes out NaN;
lonely queries keep out 0 and lse +inf whatever the sink.
"""

from __future__ import annotations

import math

import torch

from ..formats import gather_dequant_tokens, layout_of_cache, num_cache_tokens
from .problem import dense_slots
from .scheduler import TOPK_BLOCK_SIZE, ScheduleTable

__all__ = [
    "gather_kv",
    "sparse_decode_reference",
    "sparse_decode_split_reference",
    "dense_decode_reference",
    "gather_dense_kv",
    "combine_reference",
    "combine_weights",
    "LOG2E",
]

LOG2E = math.log2(math.e)


def gather_kv(
    k_cache: torch.Tensor, indices: torch.Tensor, topk_length: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather and dequantise the indexed tokens.

    Args:
        k_cache: FP8 cache ``[num_blocks, page_block_size, 1, bytes_per_token]``; its layout is
            told by ``bytes_per_token`` (656 V32, 584 MODEL1).
        indices: ``[b, s_q, topk]`` int32 cache indices.
        topk_length: optional ``[b]`` int32.

    Returns:
        ``(k, valid)``: ``k [b, s_q, topk, d_qk]`` float32 with invalid rows set to 0 (never read
        from the cache), ``valid [b, s_q, topk]`` bool.
    """
    lay = layout_of_cache(k_cache)
    n_tok = num_cache_tokens(k_cache)
    idx = indices.long()
    valid = (idx >= 0) & (idx < n_tok)
    if topk_length is not None:
        pos = torch.arange(idx.shape[-1], device=idx.device)
        valid &= pos.view(1, 1, -1) < topk_length.to(idx.device).long().view(-1, 1, 1)
    safe = torch.where(valid, idx, torch.zeros_like(idx))
    if n_tok == 0:
        k = torch.zeros(*idx.shape, lay.d_qk, dtype=torch.float32, device=idx.device)
    else:
        k = gather_dequant_tokens(k_cache, lay, safe)
        k = torch.where(valid.unsqueeze(-1), k, torch.zeros((), dtype=k.dtype, device=k.device))
    return k, valid


def _scores_and_values(q, k_cache, indices, topk_length, extra_k_cache, extra_indices, extra_topk_length, d_v):
    k, valid = gather_kv(k_cache, indices, topk_length)
    if extra_k_cache is not None:
        ke, ve = gather_kv(extra_k_cache, extra_indices, extra_topk_length)
        k = torch.cat([k, ke], dim=2)
        valid = torch.cat([valid, ve], dim=2)
    s = torch.einsum("bshd,bstd->bsht", q.float(), k)
    s = s.masked_fill(~valid.unsqueeze(2), float("-inf"))
    return s, k[..., :d_v], valid


def poisoned_rows(s: torch.Tensor) -> torch.Tensor:
    """Rows ``[..., h]`` with a NaN or ``+inf`` score on a valid key: their out and lse are NaN
    (the online softmax of the kernels gives NaN there: ``inf - inf``); ``-inf`` scores just
    get weight 0."""
    return (torch.isnan(s) | torch.isposinf(s)).any(dim=-1)


def softmax_weights(s: torch.Tensor) -> torch.Tensor:
    """The attention weights of scores ``s`` along the last dim: ``exp(s - max) / Σ exp(s - max)``.
    (``exp(s - lse)`` with an fp32 ``lse`` is off once |s| reaches ~1e5: lse's rounding error
    multiplies every weight.) A row with no finite max gets ``exp(s) / Σ``: NaN for an all ``-inf``
    row (the callers' lonely rows, masked) and for a NaN / ``+inf`` score (the poisoned rows)."""
    if s.shape[-1] == 0:
        return s
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    return p / p.sum(dim=-1, keepdim=True)


def _softmax_lse(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(weights, lse, lonely)`` of scores ``s [..., t]`` (natural units): :func:`softmax_weights`,
    the natural-log ``lse`` (NaN for a poisoned row, +inf for a row with nothing valid) and those
    lonely rows (whose out the callers set to 0)."""
    if s.shape[-1]:
        lse = torch.logsumexp(s, dim=-1)  # -inf when nothing is valid
    else:
        lse = torch.full(s.shape[:-1], float("-inf"), dtype=s.dtype, device=s.device)
    lse = torch.where(poisoned_rows(s), torch.full_like(lse, float("nan")), lse)
    lonely = torch.isneginf(lse)
    return softmax_weights(s), torch.where(lonely, torch.full_like(lse, float("inf")), lse), lonely


def _sink_factor(lse: torch.Tensor, attn_sink: torch.Tensor | None) -> torch.Tensor:
    """``exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink)``; lse [..., h], sink [h].

    NaN where the sink is NaN (it propagates) and for lonely queries with a ``+inf`` sink
    (``inf - inf``): every caller then sets lonely queries' out to 0.
    """
    if attn_sink is None:
        return torch.ones_like(lse)
    return torch.sigmoid(lse - attn_sink.float().to(lse.device))


def sparse_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float | None = None,
    d_v: int = 512,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Direct fp32 sparse decode.

    Args:
        q: ``[b, s_q, h_q, d_qk]`` (bf16; computed in fp32).
        k_cache: FP8 cache ``[num_blocks, page_block_size, 1, bytes_per_token]``.
        indices: ``[b, s_q, topk]`` int32 cache indices (``-1`` / out of range = invalid).
        sm_scale: softmax scale, default ``d_qk ** -0.5``.
        d_v: value dims (512).
        topk_length: ``[b]`` int32 or None.
        attn_sink: ``[h_q]`` float32 or None.
        extra_k_cache, extra_indices, extra_topk_length: the second cache, same rules.

    Returns:
        ``out [b, s_q, h_q, d_v]`` float32 and ``lse [b, h_q, s_q]`` float32 (natural log).
    """
    d_qk = q.shape[-1]
    sm_scale = d_qk**-0.5 if sm_scale is None else sm_scale
    s, v, _ = _scores_and_values(q, k_cache, indices, topk_length, extra_k_cache, extra_indices, extra_topk_length, d_v)
    w, lse, lonely = _softmax_lse(s * sm_scale)
    out = torch.einsum("bsht,bstd->bshd", w, v)
    out = out * _sink_factor(lse, attn_sink).unsqueeze(-1)
    out = torch.where(lonely.unsqueeze(-1), torch.zeros_like(out), out)
    return out, lse.permute(0, 2, 1).contiguous()


def combine_weights(lse_log2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights of the combine step (walkthrough step 16) for splits with log2-space LSEs.

    Returns ``(w, sum)``: ``w_i = exp2(lse_i - max)`` and ``sum = Σ w_i`` over the last dim.
    """
    m = lse_log2.max(dim=-1, keepdim=True).values
    w = torch.exp2(lse_log2 - torch.where(torch.isneginf(m), torch.zeros_like(m), m))
    return w, w.sum(dim=-1)


def combine_reference(
    o_accum: torch.Tensor,
    lse_accum: torch.Tensor,
    acc_rows: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    attn_sink: torch.Tensor | None = None,
) -> None:
    """Merge split partial results in place into ``out``/``lse`` (batches with fewer than two rows untouched).

    Args:
        o_accum: ``[rows, s_q, h_q, d_v]`` fp32 partial outputs (each normalised by its own sum).
        lse_accum: ``[rows, s_q, h_q]`` fp32 log2-space partial LSE (-inf = no valid key).
        acc_rows: ``[b + 1]`` int32 prefix sums of rows per batch (scheduler's ``acc_rows``).
        out: ``[b, s_q, h_q, d_v]`` output; lse ``[b, h_q, s_q]`` natural-log output.
    """
    ns = acc_rows.tolist()
    for i in range(len(ns) - 1):
        a, e = ns[i], ns[i + 1]
        if e - a <= 1:
            continue
        l2 = lse_accum[a:e].float()  # [n, s_q, h]
        w, tot = combine_weights(l2.permute(1, 2, 0))  # [s_q, h, n], [s_q, h]
        m = l2.max(dim=0).values
        # a split whose weight is 0 (no valid key: lse -inf) adds nothing, whatever its row holds
        # (NaN included), as in the kernel; a NaN lse still makes the sum NaN
        wn = w.permute(2, 0, 1).unsqueeze(-1)  # [n, s_q, h, 1]
        oa = o_accum[a:e].float()
        o = torch.where(wn > 0, wn * oa, torch.zeros_like(oa)).sum(dim=0) / tot.unsqueeze(-1)
        lse_nat = (torch.log2(tot) + m) / LOG2E
        lonely = torch.isneginf(m)
        lse_nat = torch.where(lonely, torch.full_like(lse_nat, float("inf")), lse_nat)
        o = o * _sink_factor(lse_nat, attn_sink).unsqueeze(-1)
        o = torch.where(lonely.unsqueeze(-1), torch.zeros_like(o), o)
        out[i] = o.to(out.dtype)
        lse[i] = lse_nat.t().to(lse.dtype)


def sparse_decode_split_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    sched: ScheduleTable,
    sm_scale: float | None = None,
    d_v: int = 512,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-KV path in fp32 following ``sched`` partition by partition, then the combine.

    Block ``k`` of batch ``i`` covers main-cache positions ``[64k, 64k + 64)`` when
    ``k < main_blocks[i]`` and extra-cache positions ``[64(k - main_blocks[i]), ...)`` otherwise.
    Same arguments and returns as :func:`sparse_decode_reference`.
    """
    b, s_q, h_q, d_qk = q.shape
    sm_scale = d_qk**-0.5 if sm_scale is None else sm_scale
    topk = indices.shape[-1]
    s, v, _ = _scores_and_values(q, k_cache, indices, topk_length, extra_k_cache, extra_indices, extra_topk_length, d_v)
    s2 = s * (sm_scale * LOG2E)  # log2-space scores [b, s_q, h, T]
    out = torch.zeros(b, s_q, h_q, d_v, dtype=torch.float32, device=q.device)
    lse = torch.zeros(b, h_q, s_q, dtype=torch.float32, device=q.device)
    rows = max(sched.num_acc_rows, 1)
    o_acc = torch.full((rows, s_q, h_q, d_v), float("nan"), device=q.device)
    l_acc = torch.full((rows, s_q, h_q), float("nan"), device=q.device)
    ns = sched.acc_rows.tolist()
    mb = sched.main_blocks.tolist()
    nb = sched.num_blocks_t.tolist()
    for r in sched.rows():
        for req in range(r["begin_req"], r["end_req"] + 1):
            blk0 = r["begin_block"] if req == r["begin_req"] else 0
            blk1 = r["end_block"] if req == r["end_req"] else nb[req]
            split = r["begin_split"] if req == r["begin_req"] else 0
            cols = []
            for k in range(blk0, blk1):
                if k < mb[req]:
                    cols.extend(range(k * TOPK_BLOCK_SIZE, min((k + 1) * TOPK_BLOCK_SIZE, topk)))
                else:
                    e0 = (k - mb[req]) * TOPK_BLOCK_SIZE
                    etopk = s2.shape[-1] - topk
                    cols.extend(range(topk + e0, topk + min(e0 + TOPK_BLOCK_SIZE, etopk)))
            cols_t = torch.tensor(cols, dtype=torch.long, device=q.device)
            sc = s2[req][..., cols_t]  # [s_q, h, n]
            m = sc.max(dim=-1).values if sc.shape[-1] else torch.full(sc.shape[:-1], float("-inf"), device=q.device)
            m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
            p = torch.exp2(sc - m_safe.unsqueeze(-1))
            psum = p.sum(-1)
            o = torch.einsum("shn,snd->shd", p, v[req][:, cols_t])
            o = o / torch.where(psum == 0, torch.ones_like(psum), psum).unsqueeze(-1)
            lse2 = torch.where(psum == 0, torch.full_like(psum, float("-inf")), torch.log2(psum) + m_safe)
            if ns[req + 1] - ns[req] <= 1:  # not split: final result directly
                lse_nat = torch.where(torch.isneginf(lse2), torch.full_like(lse2, float("inf")), lse2 / LOG2E)
                o = o * _sink_factor(lse_nat, attn_sink).unsqueeze(-1)
                out[req] = torch.where(torch.isinf(lse_nat).unsqueeze(-1) & (lse_nat > 0).unsqueeze(-1), 0.0, o)
                lse[req] = lse_nat.t()
            else:
                o_acc[ns[req] + split] = o
                l_acc[ns[req] + split] = lse2
    combine_reference(o_acc, l_acc, sched.acc_rows, out, lse, attn_sink)
    return out, lse


def gather_dense_kv(
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    s_q: int,
    causal: bool = False,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every context position of each request, through its block-table row.

    Args:
        k_cache: the FP8 cache (V32 / MODEL1 records, dequantised) or bf16/fp16 rows
            ``[num_blocks, page_block_size, 1, d_qk]``.
        block_table: ``[b, max_blocks]`` int; position ``t`` of request ``i`` is slot
            ``block_table[i, t // page_block_size] * page_block_size + t % page_block_size``.
        cache_seqlens: ``[b]`` int context lengths.
        s_q: query tokens per request.
        causal: query token ``j`` attends the positions below ``cache_seqlens[i] - s_q + j + 1``.
        dtype: of the returned keys.

    Returns:
        ``(k, valid)``: ``k [b, cap, d_qk]`` (``cap = max_blocks * page_block_size``) with the rows
        not attended by any query token set to 0 (never read from the cache), ``valid [b, s_q, cap]``.
        A position whose block-table entry lies outside the cache is not valid.
    """
    nb, pbs = k_cache.shape[0], k_cache.shape[1]
    b, max_blocks = block_table.shape
    cap = max_blocks * pbs
    dev = k_cache.device
    idx = dense_slots(block_table.to(dev), cache_seqlens, nb, pbs, s_q, causal).long()  # [b, s_q, cap]
    valid = idx >= 0
    any_valid = valid.any(dim=1)  # [b, cap]
    slots = idx.amax(dim=1).clamp(min=0)  # a position's slot, wherever some query token attends it
    fp8 = k_cache.dtype in (torch.float8_e4m3fn, torch.uint8)
    if b * cap == 0:
        k = torch.zeros(b, cap, layout_of_cache(k_cache).d_qk if fp8 else k_cache.shape[-1], device=dev)
    elif fp8:
        k = gather_dequant_tokens(k_cache, layout_of_cache(k_cache), slots)
    else:
        k = k_cache[slots // pbs, slots % pbs, 0]
    k = torch.where(any_valid.unsqueeze(-1), k.to(dtype), torch.zeros((), dtype=dtype, device=dev))
    return k, valid


def dense_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    sm_scale: float | None = None,
    d_v: int = 512,
    causal: bool = False,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense MLA decode computed directly in ``dtype`` (fp32, or float64 for an oracle).

    Args:
        q: ``[b, s_q, h_q, d_qk]`` (bf16/fp16).
        k_cache, block_table, cache_seqlens, causal: as :func:`gather_dense_kv`.
        sm_scale: softmax scale, default ``d_qk ** -0.5``.
        d_v: value dims (the first ``d_v`` columns of each key).

    Returns:
        ``out [b, s_q, h_q, d_v]`` and ``lse [b, h_q, s_q]`` (natural log) in ``dtype``; a query token
        with nothing to attend (length 0, or causal before its first position) gets out 0 and
        lse +inf.
    """
    b, s_q, h_q, d_qk = q.shape
    sm_scale = d_qk**-0.5 if sm_scale is None else sm_scale
    k, valid = gather_dense_kv(k_cache, block_table, cache_seqlens, s_q, causal, dtype)
    s = torch.einsum("bshd,btd->bsht", q.to(dtype), k) * sm_scale
    w, lse, lonely = _softmax_lse(s.masked_fill(~valid.unsqueeze(2), float("-inf")))
    out = torch.einsum("bsht,btd->bshd", w, k[..., :d_v])
    out = torch.where(lonely.unsqueeze(-1), torch.zeros_like(out), out)
    return out, lse.permute(0, 2, 1).contiguous()
