"""Validation of the training calls: the sparse prefill's backward (every tensor the forward
returned checked against the forward's problem) and the indexer's KL loss. Errors name the
argument; no Triton is imported here."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch

from ..core.checks import check_scale, check_tensor, shape_of, shown
from ..prefill.problem import PrefillProblem, validate_sparse_prefill

__all__ = [
    "BackwardProblem",
    "refuse_fp8_gradients",
    "validate_prefill_backward",
    "validate_indexer_kl_loss",
    "FLOAT_DTYPES",
]

#: floating dtypes the indexer loss takes for its inputs
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def refuse_fp8_gradients(kv_fp8: bool) -> None:
    """Raise ``ValueError`` when a gradient is asked for through the FP8 paged cache form of ``kv``."""
    if kv_fp8:
        raise ValueError(
            "kv: gradients need bf16 rows [s_kv, 1, d_qk]; the FP8 paged cache form of kv is inference-only "
            "(call with q, kv and attn_sink not requiring grad, or under torch.no_grad())"
        )


@dataclass(frozen=True)
class BackwardProblem:
    """A validated backward call of the sparse prefill.

    Attributes:
        fwd: the forward's :class:`~sparse_mla.prefill.problem.PrefillProblem` (``kv`` bf16 rows).
        out: ``[s_q, h_q, 512]`` bf16 or fp32, the forward's ``out``.
        lse: ``[s_q, h_q]`` fp32 contiguous, the forward's ``lse``.
        dout: ``[s_q, h_q, 512]`` bf16 or fp32 with a contiguous last dim: the gradient of ``out``.
    """

    fwd: PrefillProblem
    out: torch.Tensor
    lse: torch.Tensor
    dout: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.fwd.device


def _check_like(
    x: Any, name: str, shape: tuple[int, ...], dtypes: tuple, dev: torch.device, source: str = ""
) -> torch.Tensor:
    """``x`` of ``shape`` (``source``: where those sizes come from, said when they differ)."""
    check_tensor(x, name, dtypes, len(shape), dev)
    if tuple(x.shape) != shape:
        said = f" ({source})" if source else ""
        raise ValueError(f"{name}: expected shape {list(shape)}{said}, got {shape_of(x)}")
    return x


def validate_prefill_backward(
    dout: Any,
    q: Any,
    kv: Any,
    indices: Any,
    out: Any,
    lse: Any,
    sm_scale: Any,
    attn_sink: Any = None,
    topk_length: Any = None,
) -> BackwardProblem:
    """Check a backward call of the sparse prefill (the forward's arguments and outputs, and the
    gradient of ``out``) and return it as a :class:`BackwardProblem`.

    Raises:
        TypeError: an argument of the wrong type or dtype.
        ValueError: a wrong shape, device or stride, or ``kv`` the FP8 paged cache (the message
            names the argument).
    """
    fwd = validate_sparse_prefill(q, kv, indices, sm_scale, 512, attn_sink, topk_length)
    refuse_fp8_gradients(fwd.kv_fp8)
    s_q, h_q, dev = fwd.s_q, fwd.h_q, fwd.device
    floats = (torch.bfloat16, torch.float32)
    out = _check_like(out, "out", (s_q, h_q, 512), floats, dev)
    lse = _check_like(lse, "lse", (s_q, h_q), (torch.float32,), dev).contiguous()
    dout = _check_like(dout, "dout", (s_q, h_q, 512), floats, dev)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    return BackwardProblem(fwd, out, lse, dout)


@dataclass(frozen=True)
class IndexerLossProblem:
    """A validated :func:`sparse_mla.training.indexer_kl_loss` call (shapes in its docstring)."""

    q_idx: torch.Tensor
    k_idx: torch.Tensor
    weights: torch.Tensor
    q: torch.Tensor
    kv: torch.Tensor
    sm_scale: float
    indices: torch.Tensor | None
    topk_length: torch.Tensor | None
    lse: torch.Tensor | None
    block_q: int
    block_kv: int


def _check_block(x: Any, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name}: expected an int >= 1, got {shown(x)!r}")
    if x < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {shown(x)!r}")
    return int(x)


def validate_indexer_kl_loss(
    q_idx: Any,
    k_idx: Any,
    weights: Any,
    q: Any,
    kv: Any,
    sm_scale: Any,
    indices: Any,
    topk_length: Any,
    lse: Any,
    block_q: Any,
    block_kv: Any,
) -> IndexerLossProblem:
    """Check an :func:`~sparse_mla.training.indexer_kl_loss` call.

    Raises:
        TypeError: an argument of the wrong type or dtype.
        ValueError: a wrong shape, device or value (the message names the argument).
    """
    check_tensor(q_idx, "q_idx", FLOAT_DTYPES, 3)
    s_q, n_heads, d = q_idx.shape
    dev = q_idx.device
    if n_heads < 1 or d < 1:
        raise ValueError(f"q_idx: expected [s_q, H >= 1, D >= 1], got shape {shape_of(q_idx)}")
    check_tensor(k_idx, "k_idx", FLOAT_DTYPES, 2, dev, "q_idx")
    s_kv = k_idx.shape[0]
    if k_idx.shape[1] != d:
        raise ValueError(f"k_idx: expected shape [s_kv, D={d}], got {shape_of(k_idx)}")
    _check_like(weights, "weights", (s_q, n_heads), FLOAT_DTYPES, dev, "s_q and H of q_idx")
    check_tensor(q, "q", FLOAT_DTYPES, 3, dev, "q_idx")
    if q.shape[0] != s_q or q.shape[1] < 1 or q.shape[2] < 1:
        raise ValueError(f"q: expected shape [s_q={s_q} (of q_idx), h_q >= 1, d_qk >= 1], got {shape_of(q)}")
    h_q, d_qk = q.shape[1], q.shape[2]
    _check_like(kv, "kv", (s_kv, 1, d_qk), FLOAT_DTYPES, dev, "s_kv of k_idx, d_qk of q")
    scale = check_scale(sm_scale, "sm_scale")
    if indices is not None:
        check_tensor(indices, "indices", (torch.int32,), 3, dev, "q_idx")
        if indices.shape[0] != s_q or indices.shape[1] != 1:
            raise ValueError(f"indices: expected shape [s_q={s_q}, 1, topk], got {shape_of(indices)}")
    if topk_length is not None:
        if indices is None:
            raise ValueError("topk_length: only with indices (the dense loss takes every preceding key)")
        _check_like(topk_length, "topk_length", (s_q,), (torch.int32,), dev)
    if lse is not None:
        _check_like(lse, "lse", (s_q, h_q), (torch.float32, torch.float64), dev)
    return IndexerLossProblem(
        q_idx, k_idx, weights, q, kv, scale, indices, topk_length, lse,
        _check_block(block_q, "block_q"), _check_block(block_kv, "block_kv"),
    )  # fmt: skip
