"""Which implementation runs a sparse prefill, and the empty call (stage 2 of the prefill path).

``backend="auto"`` (resolved as every operation's, :mod:`sparse_mla.core.backend`): on an sm_90 GPU
(``kv`` the FP8 paged cache or bf16 rows), the decode's Gluon kernel (``hopper``); else the portable
Triton kernel where Triton runs the tensors (CUDA, or the CPU under ``TRITON_INTERPRET=1``); else the
fp32 PyTorch reference (results rounded to bf16).
"""

from __future__ import annotations

import torch

from ..core.backend import Anywhere, BackendSet, HopperOnly, TritonOnly
from .problem import PrefillProblem

__all__ = ["PREFILL_BACKENDS", "resolve_prefill_backend", "run_prefill"]

Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class HopperPrefill(HopperOnly):
    """The decode's Gluon kernel, one partition per query token (both ``kv`` forms)."""

    def launch(self, p: PrefillProblem) -> Outputs:
        from .kernels.hopper import launch

        return launch(p)


class PortablePrefill(TritonOnly):
    """The Triton ``tl`` kernel, grid ``(s_q, head tiles)``."""

    def launch(self, p: PrefillProblem) -> Outputs:
        from .kernels.portable import launch

        return launch(p)


class ReferencePrefill(Anywhere):
    """The fp32 PyTorch twin, results rounded to bf16."""

    def launch(self, p: PrefillProblem) -> Outputs:
        from .reference import sparse_prefill_reference

        out, max_logits, lse = sparse_prefill_reference(
            p.q, p.kv, p.indices, p.sm_scale, p.d_v, p.attn_sink, p.topk_length
        )
        return out.to(torch.bfloat16), max_logits, lse


#: the prefill's backends, in the order ``backend="auto"`` tries them
PREFILL_BACKENDS = BackendSet("prefill", (HopperPrefill(), PortablePrefill(), ReferencePrefill()))


def resolve_prefill_backend(p: PrefillProblem, backend: str = "auto") -> str:
    """The name of the backend that runs ``p``.

    Raises:
        TypeError / ValueError: not a string, an unknown name, or a backend that cannot serve ``p``
            (the message says why).
    """
    return PREFILL_BACKENDS.resolve(p, backend).name


@torch.no_grad()
def run_prefill(p: PrefillProblem, backend: str = "auto") -> Outputs:
    """Run a validated problem: ``(out [s_q, h_q, 512] bf16, max_logits [s_q, h_q] fp32, lse
    [s_q, h_q] fp32)``; ``s_q = 0`` launches nothing and returns empty tensors. Inference only:
    the outputs never require grad, whichever backend runs."""
    b = PREFILL_BACKENDS.resolve(p, backend)
    if p.s_q == 0:
        empty = torch.empty(0, p.h_q, dtype=torch.float32, device=p.device)
        return torch.empty(0, p.h_q, p.d_v, dtype=torch.bfloat16, device=p.device), empty, empty.clone()
    return b.launch(p)
