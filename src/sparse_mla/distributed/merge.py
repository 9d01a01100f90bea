"""Merging attention over disjoint key sets by their natural-log LSEs.

Part ``r`` attended key set ``K_r`` and returned ``out_r`` (normalised by its own softmax sum) and
``lse_r = log Σ_{k∈K_r} exp(s_k)``. Then over ``∪ K_r``::

    lse = log Σ_r exp(lse_r),    out = Σ_r exp(lse_r - lse) · out_r

A part with no valid key comes back from the decode with ``lse = +inf`` (FlashMLA's convention for
a lonely query): it counts as weight 0 (as ``-inf`` would), never as a dominant term. If every part
is empty the result is out 0 and lse +inf. A NaN LSE makes the result NaN. All LSEs are natural
logarithms (mixing in base 2 is a known engine bug). ``attn_sink`` is not part of a merge: apply
it once, to the merged result.
"""

from __future__ import annotations

import torch

__all__ = ["merge_attention_states", "merge_attention_states_reference"]


def _check(outs: torch.Tensor, lses: torch.Tensor) -> None:
    for name, x in (("outs", outs), ("lses", lses)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not outs.is_floating_point():
        raise TypeError(f"outs: expected a floating-point tensor, got {outs.dtype}")
    if lses.dtype != torch.float32:
        raise TypeError(f"lses: expected dtype torch.float32, got {lses.dtype}")
    if outs.dim() < 2 or tuple(outs.shape[:-1]) != tuple(lses.shape):
        raise ValueError(
            f"outs, lses: expected outs [R, *batch, d] and lses [R, *batch], got {list(outs.shape)} and {list(lses.shape)}"
        )
    if outs.device != lses.device:
        raise ValueError(f"lses: expected a tensor on {outs.device} (where outs is), got {lses.device}")
    if outs.shape[0] == 0:
        raise ValueError("outs, lses: expected at least one part (R >= 1), got R = 0")


def merge_attention_states(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``R`` partial attention results over disjoint key sets.

    Args:
        outs: ``[R, *batch, d]`` partial outputs (any float dtype; each normalised by its own sum).
        lses: ``[R, *batch]`` fp32 natural-log LSEs; ``+inf`` (or ``-inf``) marks a part with no key.

    Returns:
        ``(out [*batch, d] fp32, lse [*batch] fp32)``: out 0 and lse +inf where no part had a key.

    Raises:
        TypeError / ValueError: wrong dtypes, shapes or devices; no parts (R = 0).
    """
    _check(outs, lses)
    empty = torch.isinf(lses)  # +inf (lonely) or -inf: no key in this part
    lv = torch.where(empty, torch.full_like(lses, float("-inf")), lses)
    m = lv.amax(dim=0)  # NaN propagates
    lonely = torch.isneginf(m)
    m_safe = torch.where(lonely, torch.zeros_like(m), m)
    w = torch.exp(lv - m_safe)  # 0 for empty parts
    tot = w.sum(dim=0)
    lse = torch.where(lonely, torch.full_like(m, float("inf")), torch.log(tot) + m_safe)
    wn = w / torch.where(lonely, torch.ones_like(tot), tot)
    # an empty part's out (0 from the decode, or anything) is never read: weight 0 selects 0
    contrib = torch.where((wn > 0).unsqueeze(-1), wn.unsqueeze(-1) * outs.float(), torch.zeros((), device=outs.device))
    out = contrib.sum(dim=0)
    out = torch.where(torch.isnan(m).unsqueeze(-1), torch.full_like(out, float("nan")), out)
    return out, lse


def merge_attention_states_reference(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of :func:`merge_attention_states`, one output row at a time in float64."""
    _check(outs, lses)
    r = outs.shape[0]
    o2 = outs.double().reshape(r, -1, outs.shape[-1])
    l2 = lses.double().reshape(r, -1)
    out = torch.zeros(o2.shape[1:], dtype=torch.float64)
    lse = torch.zeros(l2.shape[1], dtype=torch.float64)
    for i in range(l2.shape[1]):
        parts = [j for j in range(r) if not torch.isinf(l2[j, i])]
        if any(torch.isnan(l2[j, i]) for j in range(r)):
            out[i], lse[i] = float("nan"), float("nan")
        elif not parts:
            lse[i] = float("inf")
        else:
            lse[i] = torch.logsumexp(torch.stack([l2[j, i] for j in parts]), 0)
            out[i] = sum(torch.exp(l2[j, i] - lse[i]) * o2[j, i] for j in parts)
    return out.float().reshape(outs.shape[1:]).to(outs.device), lse.float().reshape(lses.shape[1:]).to(outs.device)
