"""Which implementation runs a sparse prefill, and the empty call (stage 2 of the prefill path).

``backend="auto"``: on an sm_90 GPU (``kv`` the FP8 paged cache or bf16 rows), the decode's Gluon
kernel (:mod:`.hopper`); else the portable Triton kernel where Triton runs the tensors (CUDA, or the CPU
under ``TRITON_INTERPRET=1``); else the fp32 PyTorch reference (results rounded to bf16).
"""

from __future__ import annotations

import torch

from ..decode.backends import hopper_unsupported as device_unsupported
from ..runtime import use_triton
from .problem import PrefillProblem

__all__ = ["PREFILL_BACKENDS", "resolve_prefill_backend", "run_prefill"]

PREFILL_BACKENDS = ("hopper", "portable", "reference")


def hopper_unsupported(p: PrefillProblem) -> str | None:
    """Why the ``hopper`` prefill cannot run ``p`` (None when it can): only the device decides
    (both ``kv`` forms run)."""
    return device_unsupported(p.q.device)


def resolve_prefill_backend(p: PrefillProblem, backend: str = "auto") -> str:
    """The backend that runs ``p``.

    Raises:
        TypeError / ValueError: not a string, an unknown name, or ``"portable"`` for CPU tensors
            without the interpreter.
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a str, got {type(backend).__name__}")
    if backend == "auto":
        if hopper_unsupported(p) is None:
            return "hopper"
        return "portable" if use_triton(p.q.device) else "reference"
    if backend not in PREFILL_BACKENDS:
        raise ValueError(f"backend: expected 'auto' or one of {list(PREFILL_BACKENDS)}, got {backend!r}")
    if backend == "hopper" and (why := hopper_unsupported(p)) is not None:
        raise ValueError(f"backend: 'hopper' {why}")
    if backend == "portable" and not use_triton(p.q.device):
        raise ValueError(
            "backend: the 'portable' backend runs CPU tensors only under Triton's interpreter "
            "(set TRITON_INTERPRET=1 before Python starts)"
        )
    return backend


@torch.no_grad()
def run_prefill(p: PrefillProblem, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run a validated problem: ``(out [s_q, h_q, 512] bf16, max_logits [s_q, h_q] fp32, lse
    [s_q, h_q] fp32)``; ``s_q = 0`` launches nothing and returns empty tensors. Inference only:
    the outputs never require grad, whichever backend runs."""
    name = resolve_prefill_backend(p, backend)
    s_q, h_q, dev = p.s_q, p.h_q, p.q.device
    if s_q == 0:
        empty = torch.empty(0, h_q, dtype=torch.float32, device=dev)
        return torch.empty(0, h_q, p.d_v, dtype=torch.bfloat16, device=dev), empty, empty.clone()
    if name == "hopper":
        from .hopper import launch as hopper_launch

        return hopper_launch(p)
    if name == "portable":
        from .portable import launch

        return launch(p)
    from .reference import sparse_prefill_reference

    out, max_logits, lse = sparse_prefill_reference(p.q, p.kv, p.indices, p.sm_scale, p.d_v, p.attn_sink, p.topk_length)
    return out.to(torch.bfloat16), max_logits, lse
