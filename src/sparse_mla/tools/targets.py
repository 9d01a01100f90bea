"""The offline compile matrix: every Triton / Gluon kernel the library ships, compiled for every
:data:`~sparse_mla.core.target.TARGETS` entry with the launch configuration its own dispatcher
picks there, on a machine without a GPU (``python -m sparse_mla targets``).

Inside :func:`compiling_for` the library's public calls run on CPU tensors as if on a GPU of that
target: every dispatcher reads the target's features (:func:`~sparse_mla.core.target.dispatching_as`),
the backends that need a GPU accept the CPU tensors, Triton's active driver is replaced by one that
names the target (so a launch compiles for it: NVIDIA down to a cubin with Triton's bundled
``ptxas``, AMD down to an HSA code object), and every kernel launch is compiled instead of run
(nothing runs; the outputs stay as allocated). Each launch becomes a :class:`Launch`: the kernel,
its constexprs and launch options, and either the compiled kernel's shared memory, registers,
spills and the instructions the checks look for, or the compile error.

The checks (:func:`check_launch`), per target: the shared memory (LDS) a kernel asks for fits
:attr:`Target.shared_bytes` (a launch that does not is refused as a GPU would refuse it, so
:func:`sparse_mla.core.launcher.launch_fitting` lowers its stages as it does on hardware); no
instruction the target lacks in the PTX: ``griddepcontrol`` (PDL) below sm_90, ``cp.async.bulk``
(TMA) and ``wgmma`` outside sm_90a, an e4m3 conversion (``cvt.*e4m3``) below sm_89; on AMD no FP8
conversion instruction where the target takes the integer decode (gfx942 converts only FNUZ e4m3,
the caches store OCP e4m3).

The process must not run Triton's interpreter (``TRITON_INTERPRET=1`` makes the kernels
interpreted functions, which compile for nothing): :func:`compiling_for` says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..core.target import TARGETS, Target, dispatching_as, target

__all__ = [
    "Launch",
    "Case",
    "CASES",
    "compiling_for",
    "compile_cases",
    "check_launch",
    "target_support",
    "local_backends",
]


@dataclasses.dataclass
class Launch:
    """One kernel launch a dispatcher made inside :func:`compiling_for`, compiled for its target.

    Attributes:
        case: the call that made it (``decode V32 h64 extra`` ...).
        kernel: the kernel's name.
        consts: the constexpr arguments, by name.
        options: the launch options (``num_warps``, ``num_stages``, ...).
        grid: the launch grid.
        error: why it did not compile (None: it did).
        shared: shared memory / LDS the kernel asks for, bytes.
        regs: registers per thread (NVIDIA) / VGPRs (AMD); None where not known.
        spills: bytes spilled to local memory / scratch (0: none).
        instructions: counts of the instructions the checks look for.
        refused: the launch compiled but was refused for its shared memory (the dispatcher then
            retried with less).
        seconds: compile time.
    """

    case: str
    kernel: str
    consts: dict
    options: dict
    grid: tuple
    error: str | None = None
    shared: int = 0
    regs: int | None = None
    spills: int = 0
    instructions: dict = dataclasses.field(default_factory=dict)
    refused: bool = False
    seconds: float = 0.0

    @property
    def compiled(self) -> bool:
        """Whether the kernel compiled for the target."""
        return self.error is None


# --------------------------------------------------------------------------------------------
# compiling for a target


class _TargetDriver:
    """Triton's active driver for compiling offline: names the target, device 0, stream 0."""

    def __init__(self, gpu_target: Any) -> None:
        self._target = gpu_target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self._target

    def is_active(self) -> bool:
        return True


class Patches:
    """Attribute patches, undone in reverse order (also what ``benchmarks/launch_stub.py`` stubs with)."""

    def __init__(self) -> None:
        self._undo: list = []

    def setattr(self, obj: Any, name: str, value: Any) -> None:
        self._undo.append((obj, name, name in vars(obj), getattr(obj, name, None)))
        setattr(obj, name, value)

    def replace_everywhere(self, original: Callable, value: Callable) -> None:
        """Every module attribute of sparse_mla bound to ``original`` becomes ``value``."""
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("sparse_mla"):
                for name, v in list(vars(mod).items()):
                    if v is original:
                        self.setattr(mod, name, value)

    def undo(self) -> None:
        while self._undo:
            obj, name, had, old = self._undo.pop()
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)


def _import_kernels() -> None:
    """Import every kernel module (so their names can be patched and their kernels compiled)."""
    import importlib

    for m in (
        "decode.kernels.portable",
        "decode.kernels.combine",
        "decode.kernels.schedule",
        "decode.kernels.hopper",
        "prefill.kernels.portable",
        "prefill.kernels.hopper",
        "indexer.kernels",
        "kvcache.kernels.store",
        "kvcache.kernels.index_convert",
        "decode.op",
        "decode.eager",
        "decode.backends",
        "prefill.backends",
        "indexer.backends",
        "kvcache.backends",
    ):
        importlib.import_module(f"sparse_mla.{m}")


class _OnTheTarget(torch.Tensor):
    """A CPU tensor that says it is on the GPU (``is_cuda``), for launch wrappers that accept
    CUDA tensors by that test (the combine's)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def _combine_on_target(combine_fwd: Callable) -> Callable:
    def combine(o_accum: torch.Tensor, lse_accum: torch.Tensor, acc_rows: torch.Tensor, out: torch.Tensor, *args, **kw):
        return combine_fwd(o_accum, lse_accum, acc_rows, out.as_subclass(_OnTheTarget), *args, **kw)

    return combine


def _hopper_unsupported_for(t: Target) -> Callable[[torch.device], str | None]:
    def sm90_unsupported(dev: torch.device) -> str | None:
        return None if t.hopper else f"needs an sm_90 (Hopper) GPU, this one runs as {t.name}"

    return sm90_unsupported


@contextlib.contextmanager
def compiling_for(t: Target | str, case: str = "") -> Iterator[list[Launch]]:
    """Inside the block, the library's calls on CPU tensors dispatch as on a GPU of target ``t``
    and each kernel launch is compiled for ``t`` instead of run; yields the list the launches are
    recorded in (:class:`Launch`, in launch order; set ``case`` on the list's owner by passing it
    here or by :func:`compile_cases`). A launch whose compile fails is recorded with its error and
    the call goes on (nothing was run, so later launches still compile); a launch whose shared
    memory exceeds the target's raises Triton's ``OutOfResources`` as a GPU's loader would.

    Raises:
        RuntimeError: Triton's interpreter is on (``TRITON_INTERPRET=1``): its kernels compile
            for nothing; run in a process without it.
        ValueError / TypeError: ``t`` is not a known target.
    """
    from ..core import backend as core_backend
    from ..core import env, launcher

    t = target(t) if isinstance(t, str) else t
    if not isinstance(t, Target) or t.vendor == "cpu":
        raise ValueError(f"t: expected a GPU target ({', '.join(TARGETS)}), got {t!r}")
    if env.interpreting():
        raise RuntimeError("the compile matrix needs compiled kernels: run it in a process without TRITON_INTERPRET=1")
    import triton
    from triton.runtime import driver
    from triton.runtime.errors import OutOfResources
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    _import_kernels()
    from ..decode.kernels import combine as _combine
    from ..decode.kernels import portable as _portable

    if isinstance(_portable._sparse_decode_kernel, InterpretedFunction):
        raise RuntimeError(
            "the kernel modules were imported under TRITON_INTERPRET=1: run the compile matrix in a new process"
        )

    log: list[Launch] = []
    seen: set = set()
    pending = [0.0]  # compile time of warmups (prepare hooks), counted with the launch that follows
    original_run = JITFunction.run

    def compile_only(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        if self not in seen:  # its binder was made for another target (or none)
            seen.add(self)
            self.device_caches.clear()
        if warmup:
            t0 = time.perf_counter()
            try:
                return original_run(self, *args, grid=grid, warmup=True, **kwargs)
            finally:
                pending[0] += time.perf_counter() - t0
        names = self.arg_names
        consts = {n: kwargs[n] for n in names[len(args) :] if n in kwargs}
        options = {k: v for k, v in kwargs.items() if k not in consts}
        g = grid(dict(zip(names, args, strict=False)) | kwargs) if callable(grid) else grid
        rec = Launch(case, self.fn.__name__, consts, options, tuple(g) if isinstance(g, (tuple, list)) else (g,))
        log.append(rec)
        t0 = time.perf_counter() - pending[0]
        pending[0] = 0.0
        try:
            kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as e:  # noqa: BLE001 (every compile error is a finding)
            rec.error = _error_line(e)
            rec.seconds = time.perf_counter() - t0
            return None
        rec.seconds = time.perf_counter() - t0
        _measure(rec, kernel, t)
        if rec.shared > t.shared_bytes:
            rec.refused = True
            raise OutOfResources(rec.shared, t.shared_bytes, "shared memory")
        return None

    mp = Patches()
    saved_driver = driver._active
    saved_env = os.environ.get("SPARSE_MLA_DIRECT_LAUNCH")
    try:
        driver.set_active(_TargetDriver(t.triton_target()))
        os.environ["SPARSE_MLA_DIRECT_LAUNCH"] = "0"  # every launch through kernel[grid](...)
        mp.setattr(JITFunction, "run", compile_only)
        mp.replace_everywhere(env.use_triton, lambda device: True)
        mp.replace_everywhere(env.require_runnable, lambda *a, **k: None)
        mp.replace_everywhere(core_backend.sm90_unsupported, _hopper_unsupported_for(t))
        mp.replace_everywhere(core_backend.triton_unsupported, lambda dev: None)
        mp.replace_everywhere(_combine.combine_fwd, _combine_on_target(_combine.combine_fwd))
        mp.setattr(torch.cuda, "current_device", lambda: 0)
        mp.setattr(launcher, "_STAGE_CAP", {})
        mp.setattr(launcher, "_CACHE", {})
        with dispatching_as(t):
            yield log
    finally:
        mp.undo()
        for k in seen:
            k.device_caches.clear()
        driver._active = saved_driver
        if saved_env is None:
            os.environ.pop("SPARSE_MLA_DIRECT_LAUNCH", None)
        else:
            os.environ["SPARSE_MLA_DIRECT_LAUNCH"] = saved_env
        del triton


def _error_line(e: BaseException) -> str:
    """A compile error in one line: its type and the first informative line of its message."""
    text = str(e).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # Triton's CompilationError starts with the source position; the cause is on the last line
    pick = lines[-1] if lines and type(e).__name__ == "CompilationError" else (lines[0] if lines else "")
    pick = re.sub(r"/tmp/\S+", "<tmp>", pick)  # temporary files: the same error reads the same
    return f"{type(e).__name__}: {pick[:300]}"


# --------------------------------------------------------------------------------------------
# what a compiled kernel costs and contains

#: PTX instructions the checks look for (NVIDIA), by what they need
PTX_PATTERNS = {
    "griddepcontrol": r"griddepcontrol\.",
    "cp.async.bulk": r"cp\.async\.bulk",
    "wgmma": r"wgmma\.",
    "cvt.e4m3": r"cvt\.[a-z0-9.]*e4m3",
    "mma.e4m3": r"mma[a-z0-9._:]*\.(?:e4m3|kind::f8f6f4)",
    "cp.async": r"cp\.async\.c[ag]\.",
    "setmaxnreg": r"setmaxnreg\.",
}
#: AMD instructions the checks look for: FP8 conversions and FP8 dots
AMDGCN_PATTERNS = {
    "cvt.fp8": r"v_cvt_[a-z0-9_]*(?:fp8|bf8)[a-z0-9_]*",
    "mfma.fp8": r"v_mfma_[a-z0-9_]*(?:fp8|bf8)[a-z0-9_]*",
    "wmma.fp8": r"v_wmma_[a-z0-9_]*(?:fp8|bf8)[a-z0-9_]*",
}


def _nvidia_tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _measure(rec: Launch, kernel: Any, t: Target) -> None:
    md = kernel.metadata
    rec.shared = int(getattr(md, "shared", 0) or 0)
    asm = kernel.asm
    if t.vendor == "nvidia":
        ptx = asm.get("ptx", "")
        rec.instructions = {k: len(re.findall(p, ptx)) for k, p in PTX_PATTERNS.items()}
        rec.regs, rec.spills = _cubin_resources(asm.get("cubin", b""))
    else:
        gcn = asm.get("amdgcn", "")
        # every FP8 mnemonic by name (which conversions and dots the target's code uses)
        for p in AMDGCN_PATTERNS.values():
            for m in re.findall(p, gcn):
                rec.instructions[m] = rec.instructions.get(m, 0) + 1
        rec.regs, rec.spills = _amdgcn_resources(gcn)


def _cubin_resources(cubin: bytes) -> tuple[int | None, int]:
    """(registers, stack bytes) of a cubin's kernel, from ``cuobjdump -res-usage``: the stack is
    where ptxas spills (0: no spills)."""
    if not cubin:
        return None, 0
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        r = subprocess.run([_nvidia_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True)
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)", r.stdout)
    return (int(m.group(1)), int(m.group(2))) if m else (None, 0)


def _amdgcn_resources(gcn: str) -> tuple[int | None, int]:
    """(VGPRs, scratch bytes) of an AMD kernel from its assembly's metadata."""
    vg = re.search(r"\.vgpr_count:\s+(\d+)", gcn)
    scratch = re.search(r"\.private_segment_fixed_size:\s+(\d+)", gcn) or re.search(r"ScratchSize:\s+(\d+)", gcn)
    return (int(vg.group(1)) if vg else None), (int(scratch.group(1)) if scratch else 0)


# --------------------------------------------------------------------------------------------
# the representative calls


@dataclasses.dataclass(frozen=True)
class Case:
    """One representative call of an operation through the library's public API.

    Attributes:
        operation: the table's row (``decode``, ``prefill``, ``indexer logits``, ...).
        name: this call's variant (``V32 h64 extra`` ...).
        call: makes the inputs (CPU tensors) and calls the operation.
    """

    operation: str
    name: str
    call: Callable[[], Any]

    @property
    def label(self) -> str:
        """``operation: name``."""
        return f"{self.operation}: {self.name}"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _fp8_cache(layout: str, num_blocks: int, page_block: int) -> torch.Tensor:
    from ..formats import get_layout, quantize_k_cache

    lay = get_layout(layout)
    k = torch.randn(num_blocks, page_block, 1, lay.d_qk, generator=_gen(1)).to(torch.bfloat16)
    return quantize_k_cache(k, lay)


def _slots(rows: tuple[int, ...], topk: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(-1, n, (*rows, topk), generator=_gen(seed), dtype=torch.int32)


def _decode(
    layout: str, h_q: int, extra: bool, b: int = 2, topk: int = 128, extra_topk: int = 64, num_sms: int | None = None
) -> Callable[[], Any]:
    """The sparse decode; ``num_sms`` (None: the device's) sets the schedule's partitions."""

    def call() -> Any:
        from ..api import flash_mla_with_kvcache, get_mla_metadata
        from ..formats import get_layout

        d_qk = get_layout(layout).d_qk
        cache = _fp8_cache(layout, 4, 64)
        q = torch.randn(b, 1, h_q, d_qk, generator=_gen(2)).to(torch.bfloat16)
        kw: dict = {"indices": _slots((b, 1), topk, 256, 3)}
        if extra:
            kw |= {
                "extra_k_cache": _fp8_cache(layout, 2, 64),
                "extra_indices_in_kvcache": _slots((b, 1), extra_topk, 128, 4),
                "topk_length": torch.full((b,), topk, dtype=torch.int32),
                "extra_topk_length": torch.full((b,), extra_topk, dtype=torch.int32),
            }
        sched, _ = get_mla_metadata(num_sms=num_sms)
        return flash_mla_with_kvcache(q, cache, None, None, 512, sched, is_fp8_kvcache=True, **kw)

    return call


def _dense(d_qk: int, kv: str, b: int = 2, s_q: int = 2, h_q: int = 64, pbs: int = 64) -> Callable[[], Any]:
    """The dense decode (no indices): ``kv`` ``"bf16"``/``"fp16"`` rows, or ``"fp8"`` records of
    the layout of ``d_qk`` (V32 576, MODEL1 512); causal, contexts of 100 and 200 tokens."""

    def call() -> Any:
        from ..api import flash_mla_with_kvcache, get_mla_metadata

        dtype = torch.float16 if kv == "fp16" else torch.bfloat16
        if kv == "fp8":
            cache = _fp8_cache("V32" if d_qk == 576 else "MODEL1", 8, pbs)
        else:
            cache = torch.randn(8, pbs, 1, d_qk, generator=_gen(16)).to(dtype)
        q = torch.randn(b, s_q, h_q, d_qk, generator=_gen(17)).to(dtype)
        table = torch.arange(8, dtype=torch.int32).view(b, 4)
        lens = torch.tensor([100, 200], dtype=torch.int32)[:b]
        sched, _ = get_mla_metadata()
        return flash_mla_with_kvcache(q, cache, table, lens, 512, sched, causal=True, is_fp8_kvcache=kv == "fp8")

    return call


def _prefill(layout: str, fp8: bool, h_q: int = 64, s_q: int = 4, topk: int = 128) -> Callable[[], Any]:
    def call() -> Any:
        from ..api import flash_mla_sparse_fwd
        from ..formats import get_layout

        d_qk = get_layout(layout).d_qk
        q = torch.randn(s_q, h_q, d_qk, generator=_gen(5)).to(torch.bfloat16)
        if fp8:
            kv = _fp8_cache(layout, 4, 64)
        else:
            kv = torch.randn(256, 1, d_qk, generator=_gen(6)).to(torch.bfloat16)
        return flash_mla_sparse_fwd(q, kv, _slots((s_q, 1), topk, 256, 7), d_qk**-0.5)

    return call


def _prefill_backward(d_qk: int, h_q: int = 128, s_q: int = 4, topk: int = 128) -> Callable[[], Any]:
    """The sparse prefill's gradients (bf16 ``kv`` rows): the forward, then its backward kernel."""

    def call() -> Any:
        from ..api import flash_mla_sparse_fwd

        q = torch.randn(s_q, h_q, d_qk, generator=_gen(18)).to(torch.bfloat16).requires_grad_()
        kv = torch.randn(256, 1, d_qk, generator=_gen(19)).to(torch.bfloat16).requires_grad_()
        out = flash_mla_sparse_fwd(q, kv, _slots((s_q, 1), topk, 256, 20), d_qk**-0.5)[0]
        return torch.autograd.grad(out, (q, kv), torch.ones_like(out))

    return call


def _mqa_logits(heads: int = 64, dim: int = 128, s_q: int = 64, s_kv: int = 512) -> Callable[[], Any]:
    def call() -> Any:
        from ..indexer import fp8_mqa_logits

        q = torch.randn(s_q, heads, dim, generator=_gen(8)).to(torch.float8_e4m3fn)
        k = torch.randn(s_kv, dim, generator=_gen(9)).to(torch.float8_e4m3fn)
        ks = torch.zeros(s_q, dtype=torch.int32)
        ke = torch.full((s_q,), s_kv, dtype=torch.int32)
        return fp8_mqa_logits(q, (k, torch.ones(s_kv)), torch.ones(s_q, heads), ks, ke)

    return call


def _paged_logits(next_n: int, heads: int = 64, dim: int = 128, b: int = 2, block: int = 64) -> Callable[[], Any]:
    def call() -> Any:
        from ..indexer import fp8_paged_mqa_logits, get_paged_mqa_logits_metadata

        blocks = 8
        q = torch.randn(b, next_n, heads, dim, generator=_gen(10)).to(torch.float8_e4m3fn)
        cache = torch.randint(0, 120, (blocks, block, 1, dim + 4), generator=_gen(11), dtype=torch.uint8)
        ctx = torch.full((b,), blocks * block // b, dtype=torch.int32)
        table = torch.arange(blocks, dtype=torch.int32).view(b, blocks // b)
        meta = get_paged_mqa_logits_metadata(ctx, block, 132)
        weights = torch.ones(b * next_n, heads)
        return fp8_paged_mqa_logits(q, cache, weights, ctx, table, meta, blocks * block // b)

    return call


def _topk(n: int, k: int = 2048, rows: int = 4) -> Callable[[], Any]:
    def call() -> Any:
        from ..indexer import topk_indices

        return topk_indices(torch.randn(rows, n, generator=_gen(12)), k)

    return call


def _store(layout: str, n: int = 8) -> Callable[[], Any]:
    def call() -> Any:
        from ..formats import get_layout
        from ..kvcache.store import quantize_and_store_kv

        lay = get_layout(layout)
        cache = torch.zeros(4, 64, 1, lay.bytes_per_token, dtype=torch.uint8)
        kv = torch.randn(n, lay.d_qk, generator=_gen(13)).to(torch.bfloat16)
        return quantize_and_store_kv(kv, torch.arange(n, dtype=torch.int64) * 3, cache)

    return call


def _indexer_store(n: int = 8, dim: int = 128) -> Callable[[], Any]:
    def call() -> Any:
        from ..indexer import indexer_k_quant_and_cache

        cache = torch.zeros(4, 64, 1, dim + 4, dtype=torch.uint8)
        k = torch.randn(n, dim, generator=_gen(14)).to(torch.bfloat16)
        return indexer_k_quant_and_cache(k, cache, torch.arange(n, dtype=torch.int64) * 5)

    return call


def _index_convert(b: int = 2, topk: int = 2048) -> Callable[[], Any]:
    def call() -> Any:
        from ..kvcache.index_convert import abs_indices_to_kvcache_indices_triton

        table = torch.arange(2 * 64, dtype=torch.int32).view(b, 64)
        return abs_indices_to_kvcache_indices_triton(_slots((b, 1), topk, 4096, 15), table, 64)

    return call


def _cases() -> tuple[Case, ...]:
    out = []
    for layout in ("V32", "MODEL1"):
        for h_q in (16, 64, 128):
            for extra in (False, True):
                out.append(Case("decode", f"{layout} h{h_q}{' extra' if extra else ''}", _decode(layout, h_q, extra)))
    # sizes of 1, which Triton folds into constants: one partition, one index slot per cache
    out.append(Case("decode", "V32 h64 extra, sizes 1", _decode("V32", 64, True, topk=1, extra_topk=1, num_sms=1)))
    for d_qk, kv in ((576, "bf16"), (512, "fp16"), (576, "fp8"), (512, "fp8")):
        out.append(Case("decode", f"dense {kv} d{d_qk}", _dense(d_qk, kv)))
    for layout in ("V32", "MODEL1"):
        for fp8 in (False, True):
            out.append(Case("prefill", f"{layout} {'fp8 cache' if fp8 else 'bf16 kv'}", _prefill(layout, fp8)))
    for d_qk in (576, 512):
        out.append(Case("prefill backward", f"d{d_qk} h128 bf16 kv", _prefill_backward(d_qk)))
    out.append(Case("indexer logits", "H64 D128", _mqa_logits()))
    for next_n in (1, 2):
        out.append(Case("paged logits", f"H64 D128 next_n {next_n}", _paged_logits(next_n)))
    out.append(Case("top-k", "n 4096 (one program a row)", _topk(4096)))
    out.append(Case("top-k", "n 16384 (split path)", _topk(16384)))
    out.append(Case("top-k", "n 65536 (radix select)", _topk(65536)))
    for layout in ("V32", "MODEL1"):
        out.append(Case("cache store", layout, _store(layout)))
    out.append(Case("indexer cache store", "D128 ue8m0", _indexer_store()))
    out.append(Case("index convert", "topk 2048", _index_convert()))
    return tuple(out)


#: every representative call, in table order
CASES: tuple[Case, ...] = _cases()
#: one case per kernel family and path (every operation, the split decode and its combine, the
#: extra cache, both prefill forms, the three top-k paths): what the tests compile per target
QUICK_CASES: tuple[Case, ...] = tuple(
    c
    for c in CASES
    if c.label
    in {
        "decode: V32 h64 extra",
        "decode: V32 h64 extra, sizes 1",
        "decode: MODEL1 h16",
        "decode: dense bf16 d576",
        "decode: dense fp8 d512",
        "prefill: V32 fp8 cache",
        "prefill: MODEL1 bf16 kv",
        "prefill backward: d576 h128 bf16 kv",
        "indexer logits: H64 D128",
        "paged logits: H64 D128 next_n 1",
        "top-k: n 4096 (one program a row)",
        "top-k: n 16384 (split path)",
        "top-k: n 65536 (radix select)",
        "cache store: V32",
        "indexer cache store: D128 ue8m0",
        "index convert: topk 2048",
    }
)
#: the table's rows
OPERATIONS: tuple[str, ...] = tuple(dict.fromkeys(c.operation for c in CASES))


# --------------------------------------------------------------------------------------------
# the matrix


def compile_cases(t: Target | str, cases: Sequence[Case] = CASES) -> list[Launch]:
    """Run every case dispatching as on ``t`` (:func:`compiling_for`), each kernel launch compiled
    for ``t``; returns the launches (each with its case's label and its findings in
    :func:`check_launch`). A case whose call itself fails (not a compile: the dispatcher refused
    it) is recorded as one launch of kernel ``(call)`` with the error."""
    t = target(t) if isinstance(t, str) else t
    out: list[Launch] = []
    for case in cases:
        with compiling_for(t, case.label) as log:
            try:
                case.call()
            except Exception as e:  # noqa: BLE001 (a refused call is a finding of the matrix)
                log.append(Launch(case.label, "(call)", {}, {}, (), error=_error_line(e)))
        out.extend(log)
    return out


# --------------------------------------------------------------------------------------------
# checks and the table


def check_launch(t: Target, launch: Launch) -> list[str]:
    """What is wrong with one compiled launch on ``t``, in words (empty: nothing): a compile error,
    shared memory over the target's (unless the dispatcher retried it with less), or an
    instruction the target lacks (PDL below sm_90, TMA bulk copies and ``wgmma`` off sm_90a, an
    e4m3 conversion or dot where the target takes the integer decode / bf16 dots; on AMD an FP8
    conversion where the target's FP8 is not the caches' OCP e4m3)."""
    if launch.error is not None:
        return [launch.error]
    out = []
    if launch.shared > t.shared_bytes and not launch.refused:
        out.append(f"shared memory {launch.shared} B > {t.shared_bytes} B")
    n = launch.instructions
    if t.vendor == "nvidia":
        lacks = {
            "griddepcontrol": not t.pdl,
            "cp.async.bulk": not t.tma,
            "wgmma": not t.hopper,
            "cvt.e4m3": not t.fp8_convert,
            "mma.e4m3": not t.fp8_dot,
        }
        out += [f"{k} in the PTX ({n[k]}x), which {t.name} lacks" for k, bad in lacks.items() if bad and n.get(k)]
    elif not t.fp8_convert:
        cvt = {k: v for k, v in n.items() if k.startswith("v_cvt")}
        out += [f"{k} ({v}x) in the code object: {t.name} takes the integer FP8 decode" for k, v in cvt.items()]
    return out


def _stages(launch: Launch) -> str:
    s = launch.consts.get("NUM_STAGES", launch.options.get("num_stages"))
    return f" at {s} stage{'s' if s != 1 else ''}" if s is not None else ""


def summarize(t: Target, launches: Sequence[Launch]) -> dict[str, dict]:
    """Per operation: ``{"status", "why", "kernels", "shared", "regs", "spills", "fp8"}``, the
    status ``compiled`` (every case's launches compiled, fit and use only instructions ``t``
    has), ``partly`` (some cases do not fit in shared memory at the fewest stages: ``why`` names
    them), ``does not fit`` (no case fits) or ``fails`` (a compile error or a check failed)."""
    out: dict[str, dict] = {}
    for op in OPERATIONS:
        mine = [x for x in launches if x.case.split(":")[0] == op]
        if not mine:
            continue
        problems, no_fit = [], []
        for x in mine:
            variant = x.case.split(": ", 1)[1]
            if x.kernel == "(call)" and "OutOfResources" in (x.error or ""):
                last = [y for y in mine if y.case == x.case and y.kernel != "(call)"][-1]
                no_fit.append(f"{variant}: {last.kernel} needs {last.shared} B{_stages(last)} (has {t.shared_bytes} B)")
            else:
                problems += [f"{variant}: {x.kernel}: {p}" for p in check_launch(t, x)]
        cases = {x.case for x in mine}
        kept = [x for x in mine if x.compiled and not x.refused and x.kernel != "(call)"]
        if problems:
            status = "fails"
        elif not no_fit:
            status = "compiled"
        else:
            status = "partly" if len(no_fit) < len(cases) else "does not fit"
        fp8 = sorted({k for x in kept for k, v in x.instructions.items() if v and ("fp8" in k or "e4m3" in k)})
        out[op] = {
            "status": status,
            "why": problems + no_fit,
            "cases": len(cases),
            "kernels": sorted({x.kernel for x in kept}),
            "shared": max((x.shared for x in kept), default=0),
            "regs": max((x.regs or 0 for x in kept), default=0),
            "spills": max((x.spills for x in kept), default=0),
            "fp8": fp8,
        }
    return out


def toolchain_unsupported(t: Target) -> str | None:
    """Why the installed Triton cannot compile for ``t`` (None: it can): a trivial kernel is
    compiled for it, so a ``ptxas`` or LLVM that does not know the chip shows here."""
    import triton
    import triton.language as tl

    @triton.jit
    def _probe(x_ptr, N: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, N), tl.arange(0, N).to(tl.float32))

    with compiling_for(t, "toolchain") as log:
        _probe[(1,)](torch.zeros(16), N=16)
    return log[0].error if log else "nothing was compiled"


def matrix(
    names: Sequence[str] | None = None,
    cases: Sequence[Case] = CASES,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """The compile matrix as a JSON-able dict: ``{"triton", "targets": {name: {"toolchain",
    "operations": summarize(...), "launches": [...]}}}`` for ``names`` (default: every target).
    Runs in this process (see :func:`compiling_for`). ``progress``, if given, is called with one
    line before and after each target (a cold Triton cache takes minutes a target)."""
    import triton

    names = list(TARGETS) if names is None else [target(n).name for n in names]
    out: dict = {"triton": triton.__version__, "targets": {}}
    for i, name in enumerate(names, 1):
        t = TARGETS[name]
        t0 = time.perf_counter()
        if progress:
            progress(f"[{i}/{len(names)}] {name}: compiling {len(cases)} calls")
        why = toolchain_unsupported(t)
        launches = [] if why else compile_cases(t, cases)
        out["targets"][name] = {
            "toolchain": why,
            "operations": {} if why else summarize(t, launches),
            "launches": [
                dataclasses.asdict(x) | {"consts": {k: str(v) for k, v in x.consts.items()}} for x in launches
            ],
            "seconds": round(time.perf_counter() - t0, 1),
        }
        if progress:
            ops = out["targets"][name]["operations"]
            bad = sorted(op for op, c in ops.items() if c["status"] != "compiled")
            verdict = (
                f"no toolchain ({why})" if why else ("all compiled" if not bad else "not compiled: " + ", ".join(bad))
            )
            progress(f"[{i}/{len(names)}] {name}: {verdict} ({out['targets'][name]['seconds']:.0f} s)")
    return out


def matrix_subprocess(
    names: Sequence[str] | None = None,
    quick: bool = False,
    timeout: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """:func:`matrix` computed in a new Python process without ``TRITON_INTERPRET`` (for callers
    whose kernels are interpreted: the tests, ``targets`` under the interpreter); ``quick``:
    :data:`QUICK_CASES` only; ``progress`` receives the process's per-target lines (after it ends).

    Raises:
        RuntimeError: the process failed (its last output lines in the message).
    """
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "matrix.json")
        cmd = [
            sys.executable,
            "-m",
            "sparse_mla.tools.targets",
            "--json",
            path,
            *(["--quick"] if quick else []),
            *(["--progress"] if progress else []),
            *(names or []),
        ]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if progress:
            for line in r.stderr.splitlines():
                if line.startswith("["):
                    progress(line)
        if r.returncode != 0 or not os.path.exists(path):
            tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"the compile matrix failed (exit {r.returncode}):\n{tail}")
        with open(path) as f:
            return json.load(f)


def target_support(device: torch.device | None = None) -> dict[str, tuple[str, dict[str, str | None]]]:
    """For the local ``device`` (default: CUDA if available, else the CPU): each operation's
    backend as ``backend="auto"`` resolves it now, and why each other backend cannot serve it
    (:meth:`sparse_mla.core.backend.BackendSet.support`)."""
    from ..decode.backends import DECODE_BACKENDS
    from ..indexer.backends import INDEXER_BACKENDS
    from ..kvcache.backends import KVCACHE_BACKENDS
    from ..prefill.backends import PREFILL_BACKENDS

    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sets = {
        "decode": DECODE_BACKENDS,
        "prefill": PREFILL_BACKENDS,
        "indexer logits": INDEXER_BACKENDS,
        "paged logits": INDEXER_BACKENDS,
        "top-k": INDEXER_BACKENDS,
        "cache store": KVCACHE_BACKENDS,
        "indexer cache store": INDEXER_BACKENDS,
        "index convert": KVCACHE_BACKENDS,
    }
    return {op: (s.resolve(device).name, s.support(device)) for op, s in sets.items()}


local_backends = target_support


_STATUS_STYLE = {"compiled": "green", "partly": "yellow", "does not fit": "yellow", "fails": "red"}


def render(m: dict, console: Any, local: dict | None = None) -> None:
    """Print a :func:`matrix` (and the local device's backends, ``local`` from
    :func:`target_support`) with ``rich``."""
    from rich.table import Table

    console.print(f"[bold]Compile matrix[/bold] (Triton {m['triton']}; compiled offline, nothing run)")
    for name, r in m["targets"].items():
        t = TARGETS[name]
        title = f"{name}  {t.products}  (shared {t.shared_bytes // 1024} KiB; {r['seconds']} s)"
        if r["toolchain"]:
            console.print(
                f"[bold]{title}[/bold]: [red]Triton {m['triton']} cannot compile for it[/red]: {r['toolchain']}"
            )
            continue
        tab = Table(title=title, title_justify="left", show_lines=False)
        for col in ("operation", "status", "kernels", "smem B", "regs", "spill B", "FP8 instr", "why"):
            tab.add_column(col, overflow="fold")
        for op, c in r["operations"].items():
            style = _STATUS_STYLE[c["status"]]
            tab.add_row(
                op,
                f"[{style}]{c['status']}[/{style}]",
                str(len(c["kernels"])),
                str(c["shared"]),
                str(c["regs"]),
                str(c["spills"]),
                ", ".join(c["fp8"]) or "-",
                "; ".join(c["why"]),
            )
        console.print(tab)
    if local is not None:
        tab = Table(title="This machine: the backend each operation uses now", title_justify="left")
        for col in ("operation", "backend", "why not the others"):
            tab.add_column(col, overflow="fold")
        for op, (chosen, why) in local.items():
            tab.add_row(op, chosen, "; ".join(f"{b}: it {w}" for b, w in why.items() if w and b != chosen))
        console.print(tab)


def cmd_targets(args: Any) -> int:
    """``python -m sparse_mla targets``: the compile matrix and the local backends; 0 when every
    cell compiled or does not fit (an answer), 1 when a kernel failed a check."""
    import json

    from rich.console import Console

    from ..core.env import interpreting

    names = args.target or None
    for n in names or ():
        if target(n).vendor == "cpu":  # (target() raises a ValueError naming the known targets)
            raise ValueError("--target: the interpreter has no compile target; name a GPU target")
    if args.json:
        from .serve_sim_cli import json_path_problem

        why = json_path_problem(args.json)
        if why is not None:
            raise ValueError(f"--json: {why}")

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    m = matrix_subprocess(names, progress=say) if interpreting() else matrix(names, progress=say)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(m, f, indent=1, default=str)
    console = Console(highlight=False)
    if not console.is_terminal and console.width < 110:  # pipes and CI logs: rich assumes 80
        console = Console(highlight=False, width=110)
    render(m, console, target_support())
    bad = [op for r in m["targets"].values() for op, c in r["operations"].items() if c["status"] == "fails"]
    return 1 if bad else 0


def markdown(m: dict, date: str, commit: str) -> str:
    """The matrix as a Markdown table: one row per operation, one column per target, each cell
    ``compiled`` / ``partly`` / ``does not fit`` / ``fails`` (``compiled*``: compiled and run on
    hardware, sm_90a only), then the cases that do not fit."""
    names = list(m["targets"])
    head = f"Compiled offline on {date} (commit {commit}, Triton {m['triton']}); run on hardware: sm_90a (H100) only."
    rows = [head, "", "| operation | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for op in OPERATIONS:
        cells = []
        for n in names:
            r = m["targets"][n]
            if r["toolchain"]:
                cells.append("no toolchain")
                continue
            st = r["operations"].get(op, {}).get("status", "-")
            cells.append(st + ("*" if n == "sm_90a" and st == "compiled" else ""))
        rows.append(f"| {op} | " + " | ".join(cells) + " |")
    notes = [
        f"- {n}, {op}: {w}" for n, r in m["targets"].items() for op, c in r["operations"].items() for w in c["why"]
    ]
    return "\n".join(rows + ([""] + notes if notes else [])) + "\n"


def _main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m sparse_mla.tools.targets")
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--markdown", default=None, help="also write the Markdown table here")
    ap.add_argument("--progress", action="store_true", help="one line per target on stderr")
    ap.add_argument("targets", nargs="*")
    a = ap.parse_args(argv)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    m = matrix(a.targets or None, QUICK_CASES if a.quick else CASES, progress=say if a.progress else None)
    with open(a.json, "w") as f:
        json.dump(m, f, indent=1, default=str)
    if a.markdown:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(a.markdown, "w") as f:
            f.write(markdown(m, time.strftime("%Y-%m-%d"), commit or "unknown"))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_main())
