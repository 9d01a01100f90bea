"""Host time of an eager decode call: what the Python path costs per call, apart from the GPU.

For each small-batch shape (where eager calls are host-bound) it reports, in µs per call:

* ``host``: wall time of the call itself (it returns once the kernels are queued; the queue is
  drained outside the timed region), median of many calls;
* the stages of that path timed one by one: argument validation, the scheduler-object check,
  the backend's launch (allocations, argument packing, Triton's launcher);
* ``stub``: the same call with the backend's launch replaced by a function returning ready
  outputs (the Python path without Triton; this mode also runs on a CPU);
* ``stub_launch``: the same call on the Hopper backend with only Triton's compiled launcher stubbed
  (:mod:`benchmarks.launch_stub`): our whole Python path including our side of the two
  launches (argument packing, specialisation checks), up to the C launcher; also on a CPU, where
  the kernel modules are then loaded under ``TRITON_INTERPRET=1`` (nothing is interpreted: no
  kernel runs); ``stub_launch_out``: the same with the caller's ``out``/``lse`` (no allocation);
* on CUDA: the eager time (``triton.testing.do_bench``, as ``benchmarks.decode``), the graph
  replay time, and a cProfile of the call (``--profile``).

    python -m benchmarks.host [--only b=2] [--profile] [--json PATH]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable

import torch

if not torch.cuda.is_available():  # CPU-only: the stub modes need kernel modules defined interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

import sparse_mla as flash_mla  # noqa: E402
from sparse_mla.decode import backends as backends_mod  # noqa: E402
from sparse_mla.decode.plan import ensure_plan
from sparse_mla.decode.problem import validate_sparse_decode

from . import harness  # noqa: E402
from .harness import DecodeShape  # noqa: E402

HOST_SHAPES = [
    DecodeShape(1, 128, 1, 2048, 576, 21.8),
    DecodeShape(2, 128, 2, 2048, 576, 23.5),
    DecodeShape(2, 64, 2, 2048, 576, 22.7),
]


def host_us(fn: Callable[[], object], n: int, sync: Callable[[], None]) -> float:
    """Median wall µs of ``fn()`` over ``n`` calls; ``sync`` drains the device queue every 32
    calls, outside the timed region (so a full launch queue never blocks a timed call)."""
    times = []
    for i in range(n):
        if i % 32 == 0:
            sync()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    sync()
    return 1e6 * statistics.median(times)


def decode_call(
    inp: harness.DecodeInputs, meta: flash_mla.FlashMLASchedMeta, i: int = 0, backend: str = "auto", **kw
) -> Callable[[], object]:
    """The eager decode call on ``inp``'s ``i``-th index set with scheduler object ``meta``
    (``kw``: more keyword arguments, e.g. ``out=``/``lse=``)."""
    idx = inp.index_sets[i]
    return lambda: flash_mla.flash_mla_with_kvcache(
        inp.q, inp.k_cache, None, None, 512, meta, is_fp8_kvcache=True, indices=idx, backend=backend, **kw
    )


def stub_launch_us(inp: harness.DecodeInputs, n: int, sync: Callable[[], None], outputs: bool = False) -> float:
    """Host µs per call of the Hopper backend's path with Triton's compiled launcher stubbed
    (:mod:`benchmarks.launch_stub`); the calls rotate over the index sets (new tensors);
    ``outputs``: with the caller's ``out``/``lse`` buffers (no allocation per call)."""
    from benchmarks.launch_stub import stub_compiled_launches

    b, s_q, h_q, _ = inp.q.shape
    kw = {}
    if outputs:
        kw = dict(out=inp.q.new_empty((b, s_q, h_q, 512)), lse=inp.q.new_empty((b, h_q, s_q), dtype=torch.float32))
    with stub_compiled_launches(record=False) as log:
        meta, _ = flash_mla.get_mla_metadata()
        calls = [decode_call(inp, meta, i, backend="hopper", **kw) for i in range(len(inp.index_sets))]
        calls[0]()
        assert log, "no launch recorded"
        state = {"i": 0}

        def rotating():
            state["i"] += 1
            return calls[state["i"] % len(calls)]()

        return host_us(rotating, n, sync)


def bench_shape(s: DecodeShape, n: int, profile: bool, quick: bool) -> dict:
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    inp = harness.decode_inputs(s, device=dev)
    idx = inp.index_sets[0]
    meta, _ = flash_mla.get_mla_metadata()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    call = decode_call(inp, meta)

    def validate():
        return validate_sparse_decode(q=inp.q, k_cache=inp.k_cache, indices=idx)

    row = dict(harness.as_dict(s))
    p = validate()
    if cuda:
        call()
        sync()
        plan = meta.plan
        row["backend"] = plan.backend.name
        # a warm-up of the same calls first: on the H200's host the first shape's host numbers
        # (validation included, which does not depend on the shape) came out 2x the others'
        host_us(call, 4 * n, sync)
        row["host_us"] = host_us(call, n, sync)
        row["validate_us"] = host_us(validate, n, sync)
        row["plan_us"] = host_us(lambda: ensure_plan(meta, p), n, sync)
        row["launch_us"] = host_us(lambda: plan.backend.launch(p, plan.table, None, plan.workspace), n, sync)
        calls = [decode_call(inp, meta, i) for i in range(len(inp.index_sets))]
        state = {"i": 0}

        def rotating():
            state["i"] += 1
            return calls[state["i"] % len(calls)]()

        row["eager_us"] = harness.median_us(rotating, quick)
        row["graph_us"] = harness.graph_replay_us(lambda i: calls[i], len(calls), quick)
        if profile:
            pr = cProfile.Profile()
            pr.enable()
            host_us(call, n, sync)
            pr.disable()
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(20)
            pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(30)
            row["profile"] = buf.getvalue()
    # the Python path alone: the backend's launch replaced by ready outputs
    out = torch.empty(s.b, s.s_q, s.h_q, 512, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(s.b, s.h_q, s.s_q, dtype=torch.float32, device=dev)
    stub_meta, _ = flash_mla.get_mla_metadata()
    saved = {name: b.launch for name, b in backends_mod.BACKENDS.items()}
    try:
        for b in backends_mod.BACKENDS.values():
            b.launch = lambda *a, **k: (out, lse)
        stub_call = decode_call(inp, stub_meta)
        stub_call()
        row["stub_us"] = host_us(stub_call, n, sync)
    finally:
        for name, fn in saved.items():
            del backends_mod.BACKENDS[name].launch  # back to the class's method
            assert backends_mod.BACKENDS[name].launch.__func__ is fn.__func__
    row["stub_launch_us"] = stub_launch_us(inp, n, sync)
    row["stub_launch_out_us"] = stub_launch_us(inp, n, sync, outputs=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="shape filters k=v,k=v; several separated by ';'")
    ap.add_argument("-n", type=int, default=400, help="calls per measurement")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of the eager call (CUDA)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    rows = []
    keys = (
        "host_us",
        "validate_us",
        "plan_us",
        "launch_us",
        "stub_us",
        "stub_launch_us",
        "stub_launch_out_us",
        "eager_us",
        "graph_us",
    )
    print(
        f"{'b':>3} {'h_q':>4} {'s_q':>3} "
        + " ".join(f"{k[:-3]:>{max(11, len(k) - 3)}}" for k in keys)
        + "  (µs per call)"
    )
    for s in harness.select(HOST_SHAPES, args.only):
        r = bench_shape(s, args.n, args.profile, args.quick)
        rows.append(r)
        vals = " ".join(
            f"{r[k]:>{max(11, len(k) - 3)}.1f}" if k in r else f"{'-':>{max(11, len(k) - 3)}}" for k in keys
        )
        print(f"{s.b:>3} {s.h_q:>4} {s.s_q:>3} {vals}", flush=True)
        if "profile" in r:
            print(r["profile"])
    if torch.cuda.is_available() or args.json:
        path = harness.write_results("host", dict(rows=rows), args.json)
        print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
