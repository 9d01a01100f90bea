"""Kernel launches with less host time than ``kernel[grid](...)`` on repeated calls.

Triton's ``JITFunction.run`` binds and specialises every argument, builds a cache key and looks
the compiled kernel up on each call: ~20-30 µs of host time per launch for our 40-argument
kernels (measured on the H200's host, ``python -m benchmarks.host``), which made eager decode
calls at small batch host-bound. :func:`launch` remembers the compiled kernel per *specialisation
key* that we compute ourselves, finer than what Triton specialises on (tensor dtypes and 16-byte
alignment, the integer arguments' values, the constexpr values and launch options), and on a
hit calls the compiled kernel's launcher directly. (A new integer value is a miss: Triton's path
runs once and its kernel is remembered under the new key; the cache holds at most
:data:`MAX_KEYS` keys.)

The first call of every key, calls made while a Triton launch hook is installed (profilers), and
everything under the interpreter take Triton's normal path. The direct path drives Triton's
compiled-kernel launcher by its calling convention, which is not a public API: it runs only with
the Triton releases it was tested with (:data:`DIRECT_LAUNCH_TRITON`); any other release takes
Triton's public launch path for every launch (same results, more host time).
``SPARSE_MLA_DIRECT_LAUNCH=0`` turns the direct path off (for debugging).

A caller that repeats the same launches with other tensors of the same geometry can skip even
that: :func:`recording` captures the launches made inside it (compiled handle, grid, every
argument), :func:`make_replay` turns them into a :class:`Replay` (argument templates with the
places of the per-call tensors), and :meth:`Replay.run` relaunches with new tensors, no key or
argument packing on the way (:mod:`sparse_mla.decode.eager` keeps one per scheduler object and
call geometry).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from triton import knobs

from .env import interpreting

__all__ = [
    "launch",
    "launch_fitting",
    "direct_launch_enabled",
    "recording",
    "make_replay",
    "Replay",
    "set_smem_carveout",
    "carveout_hint",
]

_ENV = "SPARSE_MLA_DIRECT_LAUNCH"

#: the Triton releases whose compiled-kernel launcher calling convention the direct path was tested
#: with (``CompiledKernel.run(gridX, gridY, gridZ, stream, function, packed_metadata,
#: launch_metadata, enter_hook, exit_hook, *args)``); on any other release every launch takes
#: Triton's public ``kernel[grid](...)`` path (same results, more host time per launch)
DIRECT_LAUNCH_TRITON = ("3.6.0",)


@functools.cache
def _triton_tested() -> bool:
    import triton

    return triton.__version__ in DIRECT_LAUNCH_TRITON


def _direct_off() -> bool:
    """Whether the direct path is off now: ``SPARSE_MLA_DIRECT_LAUNCH=0`` (read on every call:
    tests flip it) or a Triton release it was not tested with."""
    return os.environ.get(_ENV) == "0" or not _triton_tested()


_get_stream: Callable[[int], int] | None = None


def _current_stream(dev: int) -> int:
    """The current CUDA stream's handle on device ``dev``, as Triton's own launch path gets it
    (``triton.runtime.driver.active.get_current_stream``, bound on first use)."""
    global _get_stream
    if _get_stream is None:
        from triton.runtime import driver

        _get_stream = driver.active.get_current_stream
    return _get_stream(dev)


_CACHE: dict[tuple, tuple[Any, tuple[str, ...]]] = {}
#: keys remembered at most (the cache is emptied when it is full)
MAX_KEYS = 4096


def direct_launch_enabled() -> bool:
    """Whether repeated launches go straight to the compiled kernel: on by default with a Triton
    release of :data:`DIRECT_LAUNCH_TRITON`; off under the interpreter, with any other Triton, or
    with ``SPARSE_MLA_DIRECT_LAUNCH=0``."""
    return not _direct_off() and not interpreting()


def _spec(a: Any) -> Any:
    """The key of one runtime argument: an int's value, a tensor's dtype and 16-byte alignment,
    a float's type (Triton passes it as fp32 whatever its value), tuples element by element."""
    if type(a) is int or a is None or isinstance(a, bool):
        return a
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() & 15)
    if isinstance(a, float):
        return float
    if isinstance(a, tuple):
        return tuple(_spec(x) for x in a)
    raise TypeError(f"direct launch: unexpected argument type {type(a).__name__}")


def _hooks_installed() -> bool:
    """Whether a Triton launch hook is installed (profilers): those launches go through Triton."""
    for h in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if h is not None and getattr(h, "calls", True):
            return True
    return False


def _compiled(kernel: Any, grid: tuple[int, int, int], args: tuple, consts: dict, options: dict) -> Any:
    """The compiled kernel of this specialisation, compiled now if it was not (no launch)."""
    compiled = kernel.warmup(*args, grid=grid, **consts, **options)
    return compiled.result() if hasattr(compiled, "result") else compiled


def launch(
    kernel: Any,
    grid: tuple[int, int, int],
    args: tuple,
    consts: dict,
    options: dict,
    prepare: Callable[[Any, int], None] | None = None,
) -> None:
    """``kernel[grid](*args, **consts, **options)``, through the compiled kernel's launcher when
    this specialisation was launched before.

    Args:
        kernel: a ``triton.jit`` / ``gluon.jit`` function.
        grid: three grid dimensions.
        args: the runtime arguments, positionally (tensors, ints, floats, tuples of them).
        consts: every constexpr parameter after them, by name.
        options: launch options (``num_warps``, ``num_stages``, ``maxnreg``, ...).
        prepare: called as ``prepare(compiled, device)`` before every launch, the first one
            included (the kernel is compiled first then), e.g. to set a function attribute
            (:func:`set_smem_carveout`); not called under the interpreter.
    """
    if not direct_launch_enabled():
        if prepare is not None and not interpreting():
            prepare(_compiled(kernel, grid, args, consts, options), torch.cuda.current_device())
        kernel[grid](*args, **consts, **options)
        _record(None)
        return
    dev = torch.cuda.current_device()
    # inline for the common argument types (a function call per argument costs more than the rest)
    spec = tuple(
        [a if type(a) is int else (a.dtype, a.data_ptr() & 15) if type(a) is torch.Tensor else _spec(a) for a in args]
    )
    key = (kernel, dev, spec, tuple(consts.items()), tuple(options.items()))
    hit = _CACHE.get(key)
    if hit is None or _hooks_installed():
        if prepare is not None:
            prepare(hit[0] if hit is not None else _compiled(kernel, grid, args, consts, options), dev)
        compiled = kernel[grid](*args, **consts, **options)
        names = tuple(kernel.arg_names[len(args) :])
        reusable = hit is None and compiled is not None and set(names) == set(consts)
        if reusable:
            if len(_CACHE) >= MAX_KEYS:
                _CACHE.clear()
            _CACHE[key] = (compiled, names)
        _record((compiled, grid, (*args, *(consts[n] for n in names))) if reusable else None)
        return
    compiled, names = hit
    if prepare is not None:
        prepare(compiled, dev)
    full = (*args, *(consts[n] for n in names))
    stream = _current_stream(dev)
    compiled.run(
        grid[0],
        grid[1],
        grid[2],
        stream,
        compiled.function,
        compiled.packed_metadata,
        None,  # launch metadata: only for launch hooks, excluded above
        None,
        None,
        *full,
    )
    _record((compiled, grid, full))


_CARVEOUT_SET: dict[tuple[int, int], int] = {}  # (CUfunction handle, device) -> percent set
_CARVEOUT_LOCK = threading.Lock()


@functools.cache
def carveout_hint(percent: int) -> Callable[[Any, int], None]:
    """The ``prepare`` hook of :func:`launch` that gives a kernel the carveout hint ``percent``
    (:func:`set_smem_carveout`; -1 takes an earlier hint back), one per value."""

    def prepare(compiled: Any, dev: int) -> None:
        set_smem_carveout(compiled, percent, dev)

    return prepare


def set_smem_carveout(compiled: Any, percent: int, device: int | None = None) -> None:
    """Hint the driver's split of an SM's unified L1 / shared memory for ``compiled``'s launches
    (``CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT``: ``percent`` of the most shared memory
    an SM has; the driver takes the smallest supported carveout at or above it that fits the
    kernel, so 0 means "as much L1 as the kernel's shared memory leaves"; -1 takes the hint back,
    to the cache preference the kernel was loaded with). Triton asks for the most shared memory
    (``CU_FUNC_CACHE_PREFER_SHARED``) for every kernel past 48 KB, which leaves 28 KB of L1 on
    Hopper; while a hint is set that preference is none (``CU_FUNC_CACHE_PREFER_NONE``). The
    hint belongs to the compiled kernel (every later launch of it, from any caller); it is set
    only when it changes. A no-op for None (the interpreter) and for a handle that is
    not a driver function (the host-time stub). ``device``: the CUDA device the kernel was
    loaded on (default: the current one).

    Raises:
        ValueError: ``percent`` outside -1..100.
        RuntimeError: the driver refused the attribute (its CUresult in the message).
    """
    if isinstance(percent, bool) or not isinstance(percent, int) or not -1 <= percent <= 100:
        raise ValueError(f"percent: expected -1 or an int in 0..100, got {percent!r}")
    fn = getattr(compiled, "function", None)
    if type(fn) is not int:
        return
    key = (fn, torch.cuda.current_device() if device is None else device)
    if _CARVEOUT_SET.get(key, -1) == percent:  # every launch asks: no lock while it holds
        return
    with _CARVEOUT_LOCK:
        if _CARVEOUT_SET.get(key, -1) == percent:
            return
        import ctypes

        cu = ctypes.CDLL("libcuda.so.1")
        # the cache preference Triton loaded the kernel with (PREFER_SHARED past 48 KB of shared
        # memory, else none) is dropped while a hint is set (the driver documents no precedence
        # between the two) and restored with -1
        loaded = 1 if getattr(getattr(compiled, "metadata", None), "shared", 0) > 49152 else 0
        res = cu.cuFuncSetCacheConfig(ctypes.c_void_p(fn), ctypes.c_int(loaded if percent < 0 else 0))
        if res == 0:
            res = cu.cuFuncSetAttribute(ctypes.c_void_p(fn), ctypes.c_int(9), ctypes.c_int(percent))
        if res != 0:
            raise RuntimeError(f"setting the shared-memory carveout hint {percent} failed: CUresult {res}")
        _CARVEOUT_SET[key] = percent


_STAGE_CAP: dict = {}  # (kernel, variant, warps) -> (pipeline stages, shrunk tile) that fit in shared memory


def launch_fitting(
    kernel: Any,
    grid: tuple[int, int, int],
    args: tuple,
    consts: dict,
    num_warps: int,
    num_stages: int,
    key: Any,
    shrink: tuple[str, int] | None = None,
    options: dict | None = None,
) -> None:
    """:func:`launch` with ``NUM_STAGES = num_stages`` pipeline stages, or fewer when the variant
    does not fit in shared memory (seen: MODEL1 with an extra cache wants 246 KB at 2 stages on an
    H200); when no stage count fits, ``shrink = (name, smallest)`` halves the power-of-two
    constexpr ``name`` (a tile side) down to ``smallest`` and tries every stage count again (GPUs
    with ~100 KB of shared memory: sm_86, sm_89, sm_120; fewer stages do not always take less
    shared memory: Triton's layout conversions can take more than a pipeline stage). What fits is
    remembered per ``(kernel, key)`` (``key``: what tells the variants apart, e.g. the device and
    the constexprs)."""
    import triton

    cap_key = (kernel, key, num_warps)
    tile = consts[shrink[0]] if shrink else None
    stages, tile = _STAGE_CAP.get(cap_key, (num_stages, tile))
    stages = min(stages, num_stages)
    while True:
        run = {**consts, "NUM_STAGES": stages}
        if shrink:
            run[shrink[0]] = tile
        try:
            launch(kernel, grid, args, run, {"num_warps": num_warps, **(options or {})})
            return
        except triton.runtime.errors.OutOfResources:
            if stages > 1:
                stages -= 1
            elif shrink and tile // 2 >= shrink[1]:
                tile, stages = tile // 2, num_stages
            else:
                raise
            _STAGE_CAP[cap_key] = (stages, tile)


# --------------------------------------------------------------------------------------------
# recorded launches, replayed

_recording = threading.local()  # .launches: where launch() records, inside recording() (per thread)


def _record(entry: tuple | None) -> None:
    launches = getattr(_recording, "launches", None)
    if launches is not None:
        launches.append(entry)


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Record the launches :func:`launch` makes inside the block (in this thread), in order:
    ``(compiled, grid, args)`` each (``args``: the runtime arguments, then the constexpr values,
    as the compiled launcher takes them), or None for a launch without a reusable compiled handle
    (direct path off, a launch hook installed, the interpreter) and for a :class:`Replay`'s."""
    saved = getattr(_recording, "launches", None)
    _recording.launches = []
    try:
        yield _recording.launches
    finally:
        _recording.launches = saved


def make_replay(
    launches: Sequence[tuple | None], tensors: Sequence[torch.Tensor | None], fixed: Iterable[torch.Tensor]
) -> Replay | None:
    """A :class:`Replay` of recorded ``launches`` whose per-call tensors are ``tensors`` (their
    order is the order :meth:`Replay.run` takes them in), or None when that cannot be told apart.

    Every tensor argument must be one of ``tensors`` (the same object, or else one and only one
    of them with its data pointer: a dtype view of it) or one of ``fixed`` (tensors that outlive
    the replay and stay where they are: their pointers are kept as numbers). None when a launch
    had no compiled handle, when an argument tensor is neither, is two of ``tensors`` or sits
    where two of them start, or when argument tuples nest deeper than one level.
    """
    if not launches or any(x is None for x in launches):
        return None
    fixed = tuple(fixed)
    place = _placer(tensors, fixed)
    steps = []
    used: set[int] = set()
    for compiled, grid, args in launches:
        template: list = []
        slots: list[tuple[int, int, int]] = []
        for pos, a in enumerate(args):
            nested = type(a) is tuple
            items = list(a) if nested else [a]
            for sub, x in enumerate(items):
                if type(x) is tuple:
                    return None
                if isinstance(x, torch.Tensor):
                    i = place(x)
                    if i is None:
                        return None
                    if i >= 0:
                        slots.append((pos, sub if nested else -1, i))
                        used.add(i)
                    items[sub] = x.data_ptr()
            template.append(tuple(items) if nested else items[0])
        steps.append((compiled.run, compiled.function, compiled.packed_metadata, tuple(grid), template, tuple(slots)))
    aligns = tuple((i, tensors[i].data_ptr() & 15) for i in sorted(used))
    return Replay(torch.cuda.current_device(), tuple(steps), aligns, fixed)


def _c_entry(run: Any) -> tuple[Any, bool, bool] | None:
    """``(launch, cooperative, pdl)``: the C function behind a compiled kernel's launcher ``run``
    and the two flags its Python wrapper adds, when that wrapper would only forward to it
    (Triton 3.6's ``CudaLauncher.__call__``, no global or profile scratch to allocate); None for
    any other launcher (other Triton versions, other drivers, the launch stub)."""
    import triton

    cls = type(run)
    if cls.__name__ != "CudaLauncher" or not triton.__version__.startswith("3.6."):
        return None
    try:
        params = list(inspect.signature(cls.__call__).parameters)
    except (TypeError, ValueError):
        return None
    if params != ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]:
        return None
    entry = getattr(run, "launch", None)
    coop, pdl = getattr(run, "launch_cooperative_grid", None), getattr(run, "launch_pdl", None)
    if entry is None or not isinstance(coop, bool) or not isinstance(pdl, bool):
        return None
    if getattr(run, "global_scratch_size", 1) != 0 or getattr(run, "profile_scratch_size", 1) != 0:
        return None
    return entry, coop, pdl


def _compile_steps(steps: tuple, aligns: tuple):
    """One Python function ``launch_all(tensors, stream) -> bool`` for a replay's steps: the
    alignment checks, then every launch with its argument list written out (constants inline,
    ``p<i>`` the i-th per-call tensor's pointer), so a call does no list copies or slot loops.
    Where the compiled launcher's Python wrapper would only forward (:func:`_c_entry`), its C
    entry is called directly with the arguments the wrapper would add."""
    env: dict[str, Any] = {}
    lines = ["def launch_all(t, stream):"]
    for i, align in aligns:
        lines.append(f"    p{i} = t[{i}].data_ptr()")
        lines.append(f"    if p{i} & 15 != {align}: return False")

    def const(x: Any) -> str:
        if x is None or type(x) in (int, bool):
            return repr(x)
        name = f"c{len(env)}"  # floats (repr round-trips, but nan/inf are not literals) and the rest
        env[name] = x
        return name

    for k, (run, function, metadata, grid, template, slots) in enumerate(steps):
        env[f"run{k}"], env[f"fn{k}"], env[f"md{k}"] = run, function, metadata
        exprs = [const(a) if type(a) is not tuple else [const(x) for x in a] for a in template]
        for pos, sub, i in slots:
            if sub < 0:
                exprs[pos] = f"p{i}"
            else:
                exprs[pos][sub] = f"p{i}"
        args = ", ".join(e if type(e) is str else "(" + "".join(x + ", " for x in e) + ")" for e in exprs)
        gx, gy, gz = (int(g) for g in grid)
        direct = _c_entry(run)
        if direct is None:
            lines.append(f"    run{k}({gx}, {gy}, {gz}, stream, fn{k}, md{k}, None, None, None, {args})")
        else:  # (grid, stream, function, cooperative, pdl, global and profile scratch, metadata, hooks)
            env[f"run{k}"], coop, pdl = direct
            lines.append(
                f"    run{k}({gx}, {gy}, {gz}, stream, fn{k}, {coop}, {pdl}, None, None, md{k}, None, None, None, {args})"
            )
    lines.append("    return True")
    exec(compile("\n".join(lines), "<sparse_mla replay>", "exec"), env)
    return env["launch_all"]


def _placer(tensors: Sequence[torch.Tensor | None], fixed: tuple[torch.Tensor, ...]):
    """``place(x)``: the index of tensor ``x`` in ``tensors``, -1 for one of ``fixed``, None for
    neither or unclear (see :func:`make_replay`)."""
    by_ptr: dict[int, int] = {}
    clash: set[int] = set()
    for i, t in enumerate(tensors):
        if t is not None and by_ptr.setdefault(t.data_ptr(), i) != i:
            clash.add(t.data_ptr())
    fixed_ptrs = {t.data_ptr() for t in fixed}

    def place(x: torch.Tensor) -> int | None:
        same = [i for i, t in enumerate(tensors) if t is x]
        if same:
            return same[0] if len(same) == 1 else None
        ptr = x.data_ptr()
        if ptr in clash or (ptr in by_ptr and ptr in fixed_ptrs):
            return None
        return by_ptr.get(ptr, -1 if ptr in fixed_ptrs else None)

    return place


class Replay:
    """Recorded launches (:func:`make_replay`) relaunched with other per-call tensors in the same
    argument places, through the compiled kernels' launchers.

    What the recorded arguments were derived from (shapes, strides, dtypes, scalars) must be the
    same for the new tensors; the caller guarantees that. :meth:`run` checks the rest cheaply:
    the 16-byte alignment of each new pointer (part of Triton's specialisation), the current
    device, no launch hook installed, ``SPARSE_MLA_DIRECT_LAUNCH`` not 0.
    """

    __slots__ = ("device", "steps", "aligns", "keep", "_launch_all")

    def __init__(self, device: int, steps: tuple, aligns: tuple, keep: tuple) -> None:
        self.device = device
        self.steps = steps
        self.aligns = aligns  # (index in tensors, data_ptr & 15) of each per-call tensor used
        self.keep = keep  # the fixed tensors whose pointers the templates hold
        self._launch_all = _compile_steps(steps, aligns)

    def run(self, tensors: Sequence[torch.Tensor | None]) -> bool:
        """Relaunch with ``tensors`` (in the order given to :func:`make_replay`). False, having
        launched nothing, when the checks above fail: the caller then takes the normal path."""
        if _direct_off() or _hooks_installed():
            return False
        dev = torch.cuda.current_device()
        if dev != self.device:
            return False
        if not self._launch_all(tensors, _current_stream(dev)):
            return False  # an alignment differs: nothing was launched
        if getattr(_recording, "launches", None) is not None:
            _record(None)  # a replay inside a recording cannot be recorded again
        return True
