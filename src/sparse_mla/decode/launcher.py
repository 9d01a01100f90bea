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
everything under the interpreter take Triton's normal path. ``SPARSE_MLA_DIRECT_LAUNCH=0``
turns the direct path off (for debugging).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from triton import knobs

from ..runtime import interpreting

__all__ = ["launch", "launch_fitting", "direct_launch_enabled"]

_CACHE: dict[tuple, tuple[Any, tuple[str, ...]]] = {}
#: keys remembered at most (the cache is emptied when it is full)
MAX_KEYS = 4096


def direct_launch_enabled() -> bool:
    """Whether repeated launches go straight to the compiled kernel (``SPARSE_MLA_DIRECT_LAUNCH``,
    default on; always off under the interpreter)."""
    return os.environ.get("SPARSE_MLA_DIRECT_LAUNCH", "1") != "0" and not interpreting()


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


def launch(kernel: Any, grid: tuple[int, int, int], args: tuple, consts: dict, options: dict) -> None:
    """``kernel[grid](*args, **consts, **options)``, through the compiled kernel's launcher when
    this specialisation was launched before.

    Args:
        kernel: a ``triton.jit`` / ``gluon.jit`` function.
        grid: three grid dimensions.
        args: the runtime arguments, positionally (tensors, ints, floats, tuples of them).
        consts: every constexpr parameter after them, by name.
        options: launch options (``num_warps``, ``num_stages``, ``maxnreg``, ...).
    """
    if not direct_launch_enabled():
        kernel[grid](*args, **consts, **options)
        return
    dev = torch.cuda.current_device()
    # inline for the common argument types (a function call per argument costs more than the rest)
    spec = tuple(
        [a if type(a) is int else (a.dtype, a.data_ptr() & 15) if type(a) is torch.Tensor else _spec(a) for a in args]
    )
    key = (kernel, dev, spec, tuple(consts.items()), tuple(options.items()))
    hit = _CACHE.get(key)
    if hit is None or _hooks_installed():
        compiled = kernel[grid](*args, **consts, **options)
        names = tuple(kernel.arg_names[len(args) :])
        if hit is None and compiled is not None and set(names) == set(consts):
            if len(_CACHE) >= MAX_KEYS:
                _CACHE.clear()
            _CACHE[key] = (compiled, names)
        return
    compiled, names = hit
    stream = torch._C._cuda_getCurrentRawStream(dev)
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
        *args,
        *(consts[n] for n in names),
    )


_STAGE_CAP: dict = {}  # (kernel, variant) -> most pipeline stages that fit in shared memory


def launch_fitting(
    kernel: Any, grid: tuple[int, int, int], args: tuple, consts: dict, num_warps: int, num_stages: int, key: Any
) -> None:
    """:func:`launch` with ``NUM_STAGES = num_stages`` pipeline stages, or fewer when the variant
    does not fit in shared memory (seen: MODEL1 with an extra cache wants 246 KB at 2 stages on an
    H200); the stage count that fits is remembered per ``(kernel, key)`` (``key``: what tells the
    variants apart, e.g. the device and the constexprs)."""
    import triton

    cap_key = (kernel, key, num_warps)
    stages = min(num_stages, _STAGE_CAP.get(cap_key, num_stages))
    while True:
        try:
            launch(kernel, grid, args, {**consts, "NUM_STAGES": stages}, {"num_warps": num_warps})
            return
        except triton.runtime.errors.OutOfResources:
            if stages <= 1:
                raise
            stages -= 1
            _STAGE_CAP[cap_key] = stages
