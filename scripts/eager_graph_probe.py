"""Why an eager call of a Hopper decode variant can time slower than its CUDA-graph replay: the
decode kernel's own device durations (CUPTI, through ``torch.profiler``) in both modes, each call
after an L2 flush as ``do_bench`` does, next to ``do_bench``'s numbers.

    PYTHONPATH=src:. python scripts/eager_graph_probe.py --only "b=148,d_qk=512" --variant half=hopper:half_stages=1
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import harness
from benchmarks.variants import parse_variant, problems_of
from sparse_mla.decode import get_backend
from sparse_mla.plan import plan_decode


def kernel_us(run, n: int, flush: torch.Tensor) -> dict[str, float]:
    """Median device µs per kernel name over ``n`` calls of ``run``, each after an L2 flush."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            flush.zero_()
            run()
        torch.cuda.synchronize()
    by: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA" and "zero" not in e.name and "fill" not in e.name.lower():
            by.setdefault(e.name[:48], []).append(e.device_time)
    return {k: statistics.median(v) for k, v in by.items()}


def probe(s: harness.DecodeShape, text: str, n: int, flush: torch.Tensor) -> None:
    inp = harness.decode_inputs(s)
    problems = problems_of(inp)
    n_sets = len(problems)
    plan = plan_decode(problems[0], backend="hopper")
    launch = get_backend("hopper").launch
    name, _, config, _ = parse_variant(text)
    state = {"i": 0}

    def eager():
        state["i"] += 1
        launch(problems[state["i"] % n_sets], plan.table, config)

    eager()
    torch.cuda.synchronize()
    graphs = harness.capture_graphs(lambda i: lambda: launch(problems[i], plan.table, config), n_sets)

    def replay():
        state["i"] += 1
        graphs[state["i"] % n_sets].replay()

    replay()
    torch.cuda.synchronize()
    ke = kernel_us(eager, n, flush)
    kg = kernel_us(replay, n, flush)
    de, dg = harness.median_us(eager, True), harness.median_us(replay, True)
    print(f"{s} {name}: do_bench eager {de:.1f} graph {dg:.1f} | kernels eager {ke} | graph {kg}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", required=True)
    ap.add_argument("--variant", action="append", default=[])
    ap.add_argument("--n", type=int, default=30)
    a = ap.parse_args()
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for s in harness.select(harness.DECODE_SHAPES, a.only):
        for text in a.variant or ["base=hopper:"]:
            probe(s, text, a.n, flush)


if __name__ == "__main__":
    main()
