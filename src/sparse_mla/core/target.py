"""What each GPU can do, in one place: the facts every dispatcher reads to choose a kernel variant
(FP8 decode by hardware or by integer operations, e4m3 tensor-core dots, programmatic dependent
launch, the tensor-memory accelerator, the Gluon Hopper kernels) and the limits a launch
configuration must fit (shared memory / LDS, warp size).

A :class:`Target` is looked up by name (``target("sm_80")``, for the offline compile matrix) or for
a device (:func:`device_target`, once per device). The choice of every feature is made here and
nowhere else, so what ``python -m sparse_mla targets`` prints for a name is what a GPU of that
name runs.

Why the FP8 decode differs: the V3.2 and MODEL1 caches store OCP e4m3 (``float8_e4m3fn``). NVIDIA
GPUs convert it in hardware from sm_89 (Ada) on; Triton refuses the conversion below (sm_80/86).
AMD MI300 (gfx942) converts only the FNUZ variant (a different exponent bias and NaN), so reading
the cache's bytes with it would be silently wrong; and Triton 3.6 lowers the e4m3 cast on AMD,
depending on the kernel, to the hardware's conversion (gfx950) or to a software one that reads
the NaN bytes as +-480 (seen on every AMD target, gfx950 included). Where the hardware cannot (or
Triton does not use it), the kernels decode the bytes by integer operations, exactly
(:func:`sparse_mla.core.fp8.e4m3_decode_exact`): the same values, NaN bytes included.

``SPARSE_MLA_TARGET=sm_80`` (read when the package is imported; any known name whose features the
GPU at hand has) makes every dispatcher choose as on that target: on an H100, ``sm_80`` runs
what an A100 runs (the portable kernels, the integer FP8 decode, no PDL or TMA) on the H100.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import types
from collections.abc import Iterator, Mapping

import torch

from .env import interpreting

__all__ = [
    "Target",
    "TARGETS",
    "target",
    "device_target",
    "emulated_target",
    "INTERPRETER",
    "pdl_enabled",
    "dispatching_as",
    "dispatch_target",
]

#: ``SPARSE_MLA_TARGET``: a target name, or empty / ``auto`` (read once, at import)
_TARGET_ENV = os.environ.get("SPARSE_MLA_TARGET", "").strip()


def emulated_target() -> Target | None:
    """The target named by ``SPARSE_MLA_TARGET`` (None when unset or ``auto``).

    Raises:
        ValueError: a name that is not a known target.
    """
    if _TARGET_ENV in ("", "auto"):
        return None
    try:
        return target(_TARGET_ENV)
    except ValueError as e:
        raise ValueError(f"SPARSE_MLA_TARGET: {str(e).removeprefix('target: ')}") from None


@dataclasses.dataclass(frozen=True)
class Target:
    """One GPU architecture as the kernels see it.

    Attributes:
        name: ``sm_80`` .. ``sm_120`` (NVIDIA; ``sm_90a`` and ``sm_100a`` with their
            architecture-specific instructions), ``gfx90a`` .. ``gfx1201`` (AMD), or
            ``interpreter`` (Triton's CPU interpreter).
        vendor: ``"nvidia"``, ``"amd"`` or ``"cpu"``.
        arch: what Triton's ``GPUTarget`` takes: the compute capability as an int (80, 90, ...)
            or the gfx name.
        warp_size: threads of a warp / wavefront.
        shared_bytes: the most shared memory (NVIDIA) or LDS (AMD) one program may use, bytes.
        fp8_convert: the hardware converts OCP e4m3 bytes to floats (else: integer decode).
        fp8_dot: e4m3 operands go to the tensor cores directly (the indexer's logits).
        pdl: programmatic dependent launch (``griddepcontrol``), sm_90+.
        tma: the tensor-memory accelerator's descriptor copies, sm_90+.
        hopper: the Gluon sm_90 kernels (``wgmma``, TMA, mbarriers) run here.
        products: GPUs of this architecture, for the table people read.
    """

    name: str
    vendor: str
    arch: int | str
    warp_size: int
    shared_bytes: int
    fp8_convert: bool
    fp8_dot: bool
    pdl: bool
    tma: bool
    hopper: bool
    products: str = ""

    def triton_target(self):
        """Triton's ``GPUTarget`` for compiling offline (imports Triton)."""
        from triton.backends.compiler import GPUTarget

        if self.vendor == "nvidia":
            return GPUTarget("cuda", self.arch, 32)
        if self.vendor == "amd":
            return GPUTarget("hip", self.arch, self.warp_size)
        raise ValueError(f"target {self.name!r}: the interpreter has no compile target")

    def features(self) -> dict[str, bool]:
        """The features a dispatcher chooses by: ``{fp8_convert, fp8_dot, pdl, tma, hopper}``."""
        return {f: getattr(self, f) for f in _FEATURES}

    def emulated_on(self, real: Target) -> Target:
        """This target's choices on the ``real`` GPU (its shared memory the smaller of both).

        Raises:
            ValueError: ``real`` lacks a feature this target has, or is of another vendor.
        """
        missing = [f for f, on in self.features().items() if on and not getattr(real, f)]
        if self.vendor != real.vendor or missing:
            why = f"{real.vendor}, not {self.vendor}" if self.vendor != real.vendor else f"no {', '.join(missing)}"
            raise ValueError(
                f"SPARSE_MLA_TARGET: {self.name} cannot be emulated on this {real.name} GPU ({why}); "
                "name an older target of the same vendor"
            )
        return dataclasses.replace(self, shared_bytes=min(self.shared_bytes, real.shared_bytes))


_FEATURES = ("fp8_convert", "fp8_dot", "pdl", "tma", "hopper")


def _sm_name(cc: int) -> str:
    """``sm_80`` .. ``sm_120``; Hopper and datacenter Blackwell with their ``a`` suffix."""
    return f"sm_{cc}" + ("a" if cc in (90, 100) else "")


def _nvidia(cc: int, shared_kib: int, products: str) -> Target:
    return Target(
        name=_sm_name(cc),
        vendor="nvidia",
        arch=cc,
        warp_size=32,
        shared_bytes=shared_kib * 1024,
        fp8_convert=cc >= 89,
        fp8_dot=cc >= 89,
        pdl=cc >= 90,
        tma=cc >= 90,
        hopper=cc == 90,
        products=products,
    )


def _amd(gfx: str, warp: int, lds_kib: int, ocp_fp8: bool, products: str) -> Target:
    return Target(
        name=gfx,
        vendor="amd",
        arch=gfx,
        warp_size=warp,
        shared_bytes=lds_kib * 1024,
        fp8_convert=ocp_fp8,
        fp8_dot=False,  # the indexer's e4m3 dots are tuned and checked on NVIDIA only
        pdl=False,
        tma=False,
        hopper=False,
        products=products,
    )


#: every target the library knows, by name (the compile matrix's rows)
TARGETS: Mapping[str, Target] = types.MappingProxyType(
    {
        t.name: t
        for t in (
            _nvidia(80, 163, "A100, A800, A30"),
            _nvidia(86, 99, "A10, A40, RTX 30xx, RTX A6000"),
            _nvidia(89, 99, "L4, L40S, RTX 40xx"),
            _nvidia(90, 227, "H100, H800, H200, H20"),
            _nvidia(100, 227, "B200, GB200"),
            _nvidia(120, 99, "RTX 50xx, RTX PRO 6000"),
            # every AMD target takes the exact integer decode: gfx942's FP8 hardware reads FNUZ, not
            # the caches' OCP e4m3, and Triton 3.6 lowers an fp8e4nv cast on AMD either to the
            # hardware's conversion (gfx950, in the portable decode: v_cvt_scalef32_pk_bf16_fp8) or to
            # a software one (every AMD target, a plain cast kernel: bits into an fp32 times 2^120)
            # that reads the NaN bytes 0x7F / 0xFF as +-480
            _amd("gfx90a", 64, 64, False, "MI200 (MI210, MI250X)"),
            _amd("gfx942", 64, 64, False, "MI300X, MI300A, MI325X"),
            _amd("gfx950", 64, 160, False, "MI350X, MI355X"),
            _amd("gfx1100", 32, 64, False, "RX 7900, Radeon PRO W7900"),
            _amd("gfx1201", 32, 64, False, "RX 9070"),
        )
    }
)

#: Triton's CPU interpreter: the integer FP8 decode (its e4m3 cast reads NaN bytes as +-480)
INTERPRETER = Target("interpreter", "cpu", "cpu", 32, 1 << 30, False, False, False, False, False, "any CPU")


def target(name: str) -> Target:
    """The :class:`Target` called ``name`` (``sm_90`` and ``sm_90a`` both name Hopper).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if not isinstance(name, str):
        raise TypeError(f"target: expected a str, got {type(name).__name__}")
    key = name.strip().lower().split(":")[0]  # (rocminfo's "gfx942:sramecc+:xnack-")
    if key in ("sm_90", "sm_100"):
        key += "a"
    if key == "interpreter":
        return INTERPRETER
    if key not in TARGETS:
        raise ValueError(f"target: expected one of {', '.join(TARGETS)} or interpreter, got {name!r}")
    return TARGETS[key]


def device_target(device: torch.device) -> Target:
    """The :class:`Target` that kernels on ``device`` are compiled for, looked up once per device
    (CPU tensors and ``TRITON_INTERPRET=1``: :data:`INTERPRETER`). A GPU newer than any known
    target gets the nearest older one's features within its vendor (an sm_121 gets sm_120's; an
    unknown gfx the integer FP8 decode and no Hopper features). With ``SPARSE_MLA_TARGET`` set:
    that target's choices on this GPU.

    Raises:
        ValueError: ``SPARSE_MLA_TARGET`` names an unknown target, or one this GPU cannot emulate.
    """
    if _DISPATCHING is not None:
        return _DISPATCHING
    if not isinstance(device, torch.device):
        raise TypeError(f"device: expected a torch.device, got {type(device).__name__}")
    emulated_target()  # (a bad SPARSE_MLA_TARGET is an error on every device)
    if device.type != "cuda" or interpreting():
        return INTERPRETER
    index = torch.cuda.current_device() if device.index is None else device.index
    return _cuda_device_target(index)


@functools.cache
def _cuda_device_target(index: int) -> Target:
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip is not None:
        gfx = str(getattr(props, "gcnArchName", "")).split(":")[0]
        t = TARGETS.get(gfx) or _amd(gfx or "gfx_unknown", 64, 64, False, props.name)
    else:
        cc = props.major * 10 + props.minor
        known = [t for t in TARGETS.values() if t.vendor == "nvidia" and t.arch <= cc]
        base = max(known, key=lambda t: t.arch) if known else TARGETS["sm_80"]
        # the newest known target's features, its own shared memory and name
        t = dataclasses.replace(base, name=_sm_name(cc), arch=cc, hopper=cc == 90)
        smem = getattr(props, "shared_memory_per_block_optin", 0)
        if smem:
            t = dataclasses.replace(t, shared_bytes=int(smem))
        if cc < 80:
            t = dataclasses.replace(t, fp8_convert=False, fp8_dot=False, pdl=False, tma=False)
    forced = emulated_target()
    return forced.emulated_on(t) if forced is not None else t


#: ``SPARSE_MLA_PDL=0`` (read once, at import): no programmatic dependent launch
_PDL_ENV = os.environ.get("SPARSE_MLA_PDL", "1") != "0"


def pdl_enabled(device: torch.device) -> bool:
    """Whether a kernel that follows the Hopper decode on ``device`` is launched as its
    programmatic dependent (PDL: its CTAs may be scheduled once every CTA of the decode has
    signalled, and wait with ``griddepcontrol.wait`` until the decode has completed and its
    writes are visible): on targets that have it (:attr:`Target.pdl`: sm_90+), not
    under the interpreter, unless ``SPARSE_MLA_PDL=0`` was set when the package was imported."""
    if _DISPATCHING is not None:
        return _PDL_ENV and _DISPATCHING.pdl
    if not _PDL_ENV or device.type != "cuda" or interpreting():
        return False
    return device_target(device).pdl


#: the target every dispatcher chooses for inside :func:`dispatching_as` (None: the device's own)
_DISPATCHING: Target | None = None


def dispatch_target() -> Target | None:
    """The target :func:`dispatching_as` has made every dispatcher choose for, None outside it."""
    return _DISPATCHING


@contextlib.contextmanager
def dispatching_as(t: Target | str) -> Iterator[Target]:
    """Inside the block every dispatcher chooses as on ``t``, whatever device its tensors are on:
    :func:`device_target` returns ``t`` and :func:`pdl_enabled` ``t.pdl`` (unless
    ``SPARSE_MLA_PDL=0``). What makes the offline compile matrix
    (:func:`sparse_mla.tools.targets.compiling_for`, which also compiles each launch for ``t``
    instead of running it) choose what a GPU of that name would. Blocks nest; not thread-safe.

    Raises:
        TypeError: ``t`` is neither a :class:`Target` nor a str.
        ValueError: an unknown target name.
    """
    global _DISPATCHING
    if isinstance(t, str):
        t = target(t)
    elif not isinstance(t, Target):
        raise TypeError(f"t: expected a Target or a target name, got {type(t).__name__}")
    saved, _DISPATCHING = _DISPATCHING, t
    try:
        yield t
    finally:
        _DISPATCHING = saved
