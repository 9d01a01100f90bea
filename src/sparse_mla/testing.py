"""FlashMLA's tolerances and the closeness check of a decode result against the fp32 reference,
shared by the test suite, ``sparse-mla demo`` and ``sparse-mla serve-sim`` (docs/design.md §6).

FlashMLA's own tests hold its decode kernels to, against an fp32 reference on the dequantised cache:
``out``: ``|Δ| <= 1e-3 + 2.01/128·|ref|`` elementwise and cosine distance ``1 - 2Σxy/Σ(x²+y²) <= 5e-6``;
``lse``: ``|Δ| <= 1e-6 + 8/65536·|ref|``. Non-finite entries (the ``+inf`` lse of a query with no
valid key, NaN from non-finite inputs) must sit at the same places in both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "Tolerance",
    "FLASHMLA_DECODE",
    "FLASHMLA_DENSE_DECODE",
    "FLASHMLA_PREFILL",
    "Closeness",
    "decode_closeness",
    "check_decode_close",
    "check_prefill_close",
    "cos_diff",
    "abs_e4m3",
    "abs_index_cache",
    "indexer_logits_closeness",
    "same_index_sets",
]


@dataclass(frozen=True)
class Tolerance:
    """Elementwise ``|Δ| <= abs + rel·|ref|`` bounds for out and lse, and the cosine-distance bound of out."""

    out_abs: float
    out_rel: float
    out_cos: float
    lse_abs: float
    lse_rel: float


#: FlashMLA 1.0's decode test tolerances
FLASHMLA_DECODE = Tolerance(out_abs=1e-3, out_rel=2.01 / 128, out_cos=5e-6, lse_abs=1e-6, lse_rel=8 / 65536)
#: FlashMLA 1.0's dense decode test tolerances (its out bound is tighter than the sparse one's)
FLASHMLA_DENSE_DECODE = Tolerance(out_abs=8e-4, out_rel=2.01 / 128, out_cos=5e-6, lse_abs=1e-6, lse_rel=8.01 / 65536)
#: FlashMLA 1.0's sparse prefill test tolerances (lse ones also bound max_logits)
FLASHMLA_PREFILL = Tolerance(out_abs=8e-4, out_rel=3.01 / 128, out_cos=7e-6, lse_abs=1e-6, lse_rel=2.01 / 65536)


def cos_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """FlashMLA's cosine distance ``1 - 2<x,y> / (|x|^2 + |y|^2)`` in float64 (0 when both are ~0)."""
    x, y = x.double(), y.double()
    den = (x * x + y * y).sum().item()
    if den < 1e-12:
        return 0.0
    return 1.0 - 2.0 * (x * y).sum().item() / den


@dataclass(frozen=True)
class _Diff:
    max_abs_err: float  # over the entries finite in both
    worst_excess: float  # max(|Δ| - bound): <= 0 when within tolerance
    worst_index: tuple
    n_over: int
    anomaly: str  # "" or which non-finite kind differs ("+inf", "-inf", "nan")
    cos: float


def _diff(ans: torch.Tensor, ref: torch.Tensor, abs_tol: float, rel_tol: float) -> _Diff:
    ans = ans.detach().double().cpu().clone()
    ref = ref.detach().double().cpu().clone()
    anomaly = ""
    for label, fa, fr in (
        ("+inf", torch.isposinf(ans), torch.isposinf(ref)),
        ("-inf", torch.isneginf(ans), torch.isneginf(ref)),
        ("nan", torch.isnan(ans), torch.isnan(ref)),
    ):
        if not torch.equal(fa, fr) and not anomaly:
            anomaly = f"{label} entries differ ({int(fa.sum())} vs {int(fr.sum())} in the reference; first at {(fa != fr).nonzero()[0].tolist()})"
        ans[fa | fr] = 0.0
        ref[fa | fr] = 0.0
    err = (ans - ref).abs()
    excess = err - (abs_tol + rel_tol * ref.abs())
    i = int(torch.argmax(excess)) if excess.numel() else 0
    idx = tuple(int(t) for t in torch.unravel_index(torch.tensor(i), ans.shape)) if excess.numel() else ()
    return _Diff(
        max_abs_err=err.max().item() if err.numel() else 0.0,
        worst_excess=excess.max().item() if excess.numel() else float("-inf"),
        worst_index=idx,
        n_over=int((excess > 0).sum()),
        anomaly=anomaly,
        cos=cos_diff(ans, ref),
    )


@dataclass(frozen=True)
class Closeness:
    """How a decode result compares with the reference (:func:`decode_closeness`)."""

    out_max_abs_err: float
    out_cos_dist: float
    lse_max_abs_err: float
    out_within: bool  # elementwise bound and matching non-finite entries
    cos_within: bool
    lse_within: bool
    detail: str  # why not, when not ok

    @property
    def ok(self) -> bool:
        return self.out_within and self.cos_within and self.lse_within


def decode_closeness(
    out: torch.Tensor,
    lse: torch.Tensor,
    ref_out: torch.Tensor,
    ref_lse: torch.Tensor,
    tol: Tolerance = FLASHMLA_DECODE,
    finite: bool = True,
) -> Closeness:
    """Compare ``(out, lse)`` with the fp32 reference under ``tol``; ``finite`` also requires ``out``
    to be finite everywhere. Shapes must match (else ``ValueError``); dtypes are not compared."""
    for name, a, r in (("out", out, ref_out), ("lse", lse, ref_lse)):
        if a.shape != r.shape:
            raise ValueError(f"{name}: shape {list(a.shape)} != reference {list(r.shape)}")
    do = _diff(out, ref_out, tol.out_abs, tol.out_rel)
    dl = _diff(lse, ref_lse, tol.lse_abs, tol.lse_rel)
    details = []
    out_finite = bool(torch.isfinite(out.float()).all()) if finite else True
    if not out_finite:
        details.append("out: has non-finite entries")
    for name, d, t in (("out", do, (tol.out_abs, tol.out_rel)), ("lse", dl, (tol.lse_abs, tol.lse_rel))):
        if d.anomaly:
            details.append(f"{name}: {d.anomaly}")
        if d.n_over:
            details.append(
                f"{name}: {d.n_over} entries out of tolerance (|d| <= {t[0]:g} + {t[1]:g}|ref|), worst at "
                f"{list(d.worst_index)} by {d.worst_excess:.3g}; max |d| = {d.max_abs_err:.3g}"
            )
    if do.cos > tol.out_cos:
        details.append(f"out: cosine distance {do.cos:.3g} > {tol.out_cos:g}")
    return Closeness(
        out_max_abs_err=do.max_abs_err,
        out_cos_dist=do.cos,
        lse_max_abs_err=dl.max_abs_err,
        out_within=out_finite and not do.anomaly and do.n_over == 0,
        cos_within=do.cos <= tol.out_cos,
        lse_within=not dl.anomaly and dl.n_over == 0,
        detail="; ".join(details),
    )


def check_decode_close(
    out: torch.Tensor,
    lse: torch.Tensor,
    ref_out: torch.Tensor,
    ref_lse: torch.Tensor,
    finite: bool = True,
    tol: Tolerance = FLASHMLA_DECODE,
) -> None:
    """Assert :func:`decode_closeness` (``AssertionError`` saying what is off and where).

    ``finite=False`` lets out hold NaN where the reference does (inputs with inf/NaN)."""
    try:
        c = decode_closeness(out, lse, ref_out, ref_lse, tol, finite)
    except ValueError as e:  # shapes differ
        raise AssertionError(str(e)) from None
    assert c.ok, c.detail


def check_prefill_close(
    out: torch.Tensor,
    max_logits: torch.Tensor,
    lse: torch.Tensor,
    ref_out: torch.Tensor,
    ref_max_logits: torch.Tensor,
    ref_lse: torch.Tensor,
    finite: bool = True,
    tol: Tolerance = FLASHMLA_PREFILL,
) -> None:
    """Assert a sparse prefill result is within FlashMLA's prefill tolerances of the fp32
    reference: ``out`` and ``lse`` as :func:`check_decode_close`, ``max_logits`` with the lse
    bounds (non-finite entries at the same places)."""
    check_decode_close(out, lse, ref_out, ref_lse, finite, tol)
    if max_logits.shape != ref_max_logits.shape:
        raise AssertionError(f"max_logits: shape {list(max_logits.shape)} != reference {list(ref_max_logits.shape)}")
    d = _diff(max_logits, ref_max_logits, tol.lse_abs, tol.lse_rel)
    assert not d.anomaly, f"max_logits: {d.anomaly}"
    assert d.n_over == 0, (
        f"max_logits: {d.n_over} entries out of tolerance, worst at {list(d.worst_index)}; max |d| = {d.max_abs_err:.3g}"
    )


# ------------------------------------------------------------------------------ indexer logits


def abs_e4m3(t: torch.Tensor) -> torch.Tensor:
    """``|t|`` of e4m3 values (float8_e4m3fn or their uint8 bytes; the sign bit cleared, NaN stays NaN)."""
    return (t.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)


def abs_index_cache(cache: torch.Tensor) -> torch.Tensor:
    """A copy of the indexer key cache ``[num_blocks, block_size, 1, D + 4]`` uint8 with ``|key|``
    bytes (its fp32 scales, positive, untouched)."""
    nb, bs, _, w = cache.shape
    c = cache.clone().view(nb, bs * w)
    c[:, : bs * (w - 4)] &= 0x7F
    return c.view(cache.shape)


def indexer_logits_closeness(
    got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor, tensor_cores: bool
) -> tuple[bool, float, float]:
    """Indexer logits against the twin (docs/design.md §6): the same finite entries, and there
    ``|got - want| <= rel · magnitude + 1e-4`` with ``magnitude`` the twin evaluated on ``|q|``,
    ``|k|``, ``|w|`` (the size of the dot's terms, which cancel in the dot) and ``rel`` 2^-11 on
    e4m3 tensor cores (the MMA keeps ~14 bits of the terms), 1e-5 elsewhere.

    Returns ``(ok, max |got - want|, worst excess over the bound)`` over the finite entries."""
    rel = 2.0**-11 if tensor_cores else 1e-5
    fin = torch.isfinite(want)
    err = (got[fin] - want[fin]).abs()
    excess = err - rel * magnitude[fin] - 1e-4
    worst = float(excess.max()) if excess.numel() else 0.0
    same_fin = bool(torch.equal(fin, torch.isfinite(got)))
    return same_fin and worst <= 0, float(err.max()) if err.numel() else 0.0, worst


def same_index_sets(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Top-k results (positions or cache slots, ``[..., k]``) that agree as sets: along the last
    dimension the same entries in any order (``sorted=False``), and ``-1`` in the same places."""
    got, want = got.cpu(), want.cpu()
    return torch.equal(got == -1, want == -1) and torch.equal(got.sort(dim=-1).values, want.sort(dim=-1).values)
