"""Time kernel variants side by side, in one process: a variant is a backend with a launch config
(:class:`sparse_mla.decode.kernels.hopper.HopperConfig`, :class:`sparse_mla.decode.kernels.portable.PortableConfig`).
A variant marked ``check`` is first compared with the fp32 reference on small shapes (split and
unsplit schedules) and reported FAIL if it misses FlashMLA's tolerances.

    python -m benchmarks.variants [--set small_heads] [--only b=64,h_q=128] [--variant NAME=BACKEND:KEY=V,KEY=V[:check]] ... [--graph] [--full]

Without ``--variant`` a built-in list runs (the Hopper kernel with its defaults and with the 64-head
tiles' 32-token ring stages forced on and off, and the portable kernel at two block sizes); e.g.
``--variant regs120=hopper:producer_regs=120:check``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

import torch

import sparse_mla as flash_mla
from sparse_mla.decode import get_backend
from sparse_mla.decode.kernels.hopper import HopperConfig
from sparse_mla.decode.kernels.portable import PortableConfig
from sparse_mla.decode.plan import plan_decode
from sparse_mla.decode.problem import validate_sparse_decode
from sparse_mla.reference import sparse_decode_reference
from sparse_mla.testing import decode_closeness

from . import harness

CONFIGS = {"hopper": HopperConfig, "portable": PortableConfig}
DEFAULT = [
    ("hopper", "hopper", HopperConfig(), True),
    ("hopper half_stages=1", "hopper", HopperConfig(half_stages=True), True),
    ("hopper half_stages=0", "hopper", HopperConfig(half_stages=False), True),
    ("portable", "portable", PortableConfig(), True),
    ("portable block_n=32", "portable", PortableConfig(block_n=32), True),
]


def _field_value(ftype: Any, v: str, text: str) -> Any:
    """A config field's value from its text: bools (``1/0/true/false``; ``none`` where the field
    takes None, e.g. ``HopperConfig.half_stages``) or ints."""
    name = ftype if isinstance(ftype, str) else getattr(ftype, "__name__", str(ftype))
    low = v.lower()
    if "None" in name and low == "none":
        return None
    if "bool" in name:
        if low not in ("1", "0", "true", "false"):
            raise SystemExit(f"--variant {text!r}: {v!r} is not a bool (1/0/true/false)")
        return low in ("1", "true")
    return int(v)


def parse_variant(text: str) -> tuple[str, str, Any, bool]:
    """``NAME=BACKEND:KEY=V,KEY=V[:check]`` -> (name, backend, config, check)."""
    check = text.endswith(":check")
    text = text[: -len(":check")] if check else text
    name, _, rest = text.partition("=")
    backend, _, kvs = rest.partition(":")
    if backend not in CONFIGS:
        raise SystemExit(f"--variant {text!r}: backend must be one of {sorted(CONFIGS)}")
    fields = {f.name: f.type for f in dataclasses.fields(CONFIGS[backend])}
    kw = {}
    for kv in filter(None, kvs.split(",")):
        k, _, v = kv.partition("=")
        if k not in fields:
            raise SystemExit(f"--variant {text!r}: {CONFIGS[backend].__name__} has no field {k!r} ({sorted(fields)})")
        kw[k] = _field_value(fields[k], v, text)
    return name, backend, CONFIGS[backend](**kw), check


def set_hopper_default(spec: str) -> None:
    """Make ``HopperConfig(KEY=V,...)`` (``spec``, as in ``--variant``) the Hopper kernel's default
    for this process (``--hopper-config`` of the benchmarks and of the test suite); "" leaves it."""
    if spec:
        from sparse_mla.decode.kernels import hopper

        hopper.DEFAULT_CONFIG = parse_variant(f"cli=hopper:{spec}")[2]


def check_variant(backend: str, config: Any) -> str:
    """Compare the variant with the fp32 reference on small V32 shapes, split and unsplit."""
    g = torch.Generator(device="cuda").manual_seed(7)
    nb = 64
    k = (torch.randn(nb, 64, 1, 576, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    kc = flash_mla.quantize_k_cache(k, "V32")
    worst = ""
    for b, h_q, num_sms in ((4, 128, None), (4, 128, 8), (3, 20, None), (3, 16, None), (5, 12, 8)):
        q = torch.randn(b, 2, h_q, 576, device="cuda", generator=g).to(torch.bfloat16)
        idx = torch.randint(-64, nb * 64, (b, 2, 512), device="cuda", generator=g, dtype=torch.int32)
        p = validate_sparse_decode(q=q, k_cache=kc, indices=idx)
        plan = plan_decode(p, num_sms, backend)
        out, lse = get_backend(backend).launch(p, plan.table, config)
        c = decode_closeness(out, lse, *sparse_decode_reference(q, kc, idx))
        if not c.ok:
            return f"FAIL b={b} h_q={h_q} num_sms={num_sms}: {c.detail[:200]}"
        worst = f"max |d out| {c.out_max_abs_err:.1e}"
    return "PASS " + worst


def problems_of(inp: harness.DecodeInputs) -> list:
    """The validated problems of every index set of ``inp``, with everything the shape's call takes
    (the extra cache, its indices and lengths, topk_length: the row's whole work)."""
    return [
        validate_sparse_decode(q=inp.q, k_cache=inp.k_cache, **inp.call_kwargs(i)) for i in range(len(inp.index_sets))
    ]


def time_variant(s: harness.DecodeShape, backend: str, config: Any, quick: bool, graph: bool = False) -> dict:
    """µs of the variant's decode kernel (no combine): eager calls in rotation over the shape's
    index sets, and with ``graph`` one CUDA graph per index set replayed in rotation too."""
    inp = harness.decode_inputs(s)
    n = len(inp.index_sets)
    problems = problems_of(inp)
    plan = plan_decode(problems[0], backend=backend)
    launch = get_backend(backend).launch
    state = {"i": 0}

    def call():
        state["i"] += 1
        return launch(problems[state["i"] % n], plan.table, config)

    call()
    torch.cuda.synchronize()
    res = {"us": harness.median_us(call, quick)}
    if graph:
        res["us_graph"] = harness.graph_replay_us(lambda i: lambda: launch(problems[i], plan.table, config), n, quick)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--only",
        default=None,
        help="shape filters k=v,k=v; several separated by ';' (default: b=64,h_q=128,d_qk=576, or with "
        "--set small_heads b=128,h_q=16,d_qk=576)",
    )
    ap.add_argument("--set", default="default", choices=sorted(harness.SHAPE_SETS), help="row set to filter")
    ap.add_argument("--variant", action="append", default=[], help="NAME=BACKEND:KEY=V,KEY=V[:check]")
    ap.add_argument("--full", action="store_true", help="full repetitions (default quick)")
    ap.add_argument("--graph", action="store_true", help="also time CUDA-graph replay (one graph per index set)")
    ap.add_argument("--json", help="write the results here (default: benchmarks/results/<date>_<gpu>_variants.json)")
    a = ap.parse_args(argv)
    if not harness.has_cuda("benchmarks.variants"):
        return 2
    variants = [parse_variant(v) for v in a.variant] or DEFAULT
    only = a.only or ("b=128,h_q=16,d_qk=576" if a.set == "small_heads" else "b=64,h_q=128,d_qk=576")
    shapes = harness.select(harness.SHAPE_SETS[a.set], only)
    if not shapes:
        print(f"benchmarks.variants: --only {only!r} selects no row of the {a.set} set", file=sys.stderr)
        return 2
    out = []
    for name, backend, config, check in variants:
        res = dict(name=name, backend=backend, config=dataclasses.asdict(config), rows=[])
        if check:
            res["check"] = check_variant(backend, config)
        for s in shapes:
            try:
                res["rows"].append(dict(harness.as_dict(s), **time_variant(s, backend, config, not a.full, a.graph)))
                torch.cuda.empty_cache()
            except ValueError as e:  # the backend cannot serve this shape
                res.setdefault("skipped", []).append(f"{s}: {e}")
        out.append(res)
        us = ", ".join(
            f"b={r['b']} h_q={r['h_q']} d_qk={r['d_qk']}: {r['us']:.1f}"
            + (f" / graph {r['us_graph']:.1f}" if "us_graph" in r else "")
            + " us"
            for r in res["rows"]
        )
        print(f"{name:24s} {res.get('check', ''):40s} {us}", flush=True)
    print(f"results: {harness.write_results('variants', dict(quick=not a.full, variants=out), a.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
