"""Which implementation runs the sparse prefill's backward (``backend=``, resolved as every
operation's, :mod:`sparse_mla.core.backend`): the portable Triton kernels where Triton runs the
tensors (CUDA, or the CPU under ``TRITON_INTERPRET=1``), else the fp32 PyTorch twin."""

from __future__ import annotations

import torch

from ..core.backend import Anywhere, BackendSet, TritonOnly
from .problem import BackwardProblem

__all__ = ["BACKWARD_BACKENDS", "run_prefill_backward", "backward_backend_name"]

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def _sink_terms(p: BackwardProblem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(D [s_q, h_q], lse' [s_q, h_q], dsink [h_q] or None)`` in fp32: ``D = rowsum(dO ∘ out)``,
    ``lse' = logaddexp(lse, sink)`` and ``dsink = −Σ_t sigmoid(sink − lse)·D`` (0 for lonely rows)."""
    delta = (p.dout.float() * p.out.float()).sum(dim=-1).contiguous()
    sink = p.fwd.attn_sink
    if sink is None:
        return delta, p.lse, None
    lse_eff = torch.logaddexp(p.lse, sink.view(1, -1)).contiguous()
    w = torch.sigmoid(sink.view(1, -1) - p.lse) * delta
    dsink = -torch.where(torch.isposinf(p.lse), torch.zeros_like(w), w).sum(dim=0)
    return delta, lse_eff, dsink


class PortableBackward(TritonOnly):
    """The Triton ``tl`` kernels: ``dq`` (grid ``(s_q, head tiles)``) and ``dkv`` (one program per
    token and block of its listed rows, summed over the heads before one fp32 atomic add each)."""

    def launch(self, p: BackwardProblem) -> Grads:
        from .kernels.backward import launch

        delta, lse_eff, dsink = _sink_terms(p)
        f = p.fwd
        dq, dkv = launch(f.q, f.kv, f.indices, f.sm_scale, p.dout, delta, lse_eff, f.topk_length)
        return dq, dkv.unsqueeze(1), dsink


class ReferenceBackward(Anywhere):
    """The fp32 PyTorch twin."""

    def launch(self, p: BackwardProblem) -> Grads:
        from .reference import sparse_prefill_backward_reference

        f = p.fwd
        return sparse_prefill_backward_reference(
            f.q, f.kv, f.indices, f.sm_scale, p.out, p.lse, p.dout, f.attn_sink, f.topk_length
        )


#: the backward's backends, in the order ``backend="auto"`` tries them
BACKWARD_BACKENDS = BackendSet("prefill backward", (PortableBackward(), ReferenceBackward()))


def backward_backend_name(forward_backend: str) -> str:
    """The backend the backward runs on after a forward run with ``forward_backend``: the same
    name where the backward has it (``portable``, ``reference``), else ``"auto"`` (``hopper``
    has no backward kernel)."""
    return forward_backend if forward_backend in BACKWARD_BACKENDS.by_name else "auto"


@torch.no_grad()
def run_prefill_backward(p: BackwardProblem, backend: str = "auto") -> Grads:
    """Run a validated backward: ``(dq [s_q, h_q, d_qk], dkv [s_kv, 1, d_qk], dsink [h_q] or
    None)``, float32 (the caller casts to the inputs' dtypes). ``s_q = 0`` launches nothing."""
    b = BACKWARD_BACKENDS.resolve(p, backend)
    f = p.fwd
    if f.s_q == 0:
        dsink = None if f.attn_sink is None else torch.zeros(f.h_q, dtype=torch.float32, device=f.device)
        return (
            torch.zeros(f.q.shape, dtype=torch.float32, device=f.device),
            torch.zeros(f.kv.shape, dtype=torch.float32, device=f.device),
            dsink,
        )
    return b.launch(p)
