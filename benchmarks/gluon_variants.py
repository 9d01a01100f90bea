"""Time Gluon-kernel variants (environment knobs of ``ops/sparse_decode_gluon.py``) side by side.

Each variant runs in its own process (the knobs are read at import), on the same shapes as
``bench_decode.py``; a variant marked ``check`` first runs the Gluon test suite's reference
comparisons under the same knobs (``-k`` filter below) and is reported FAIL if they fail.

    python benchmarks/gluon_variants.py [--only b=64,h_q=128] [--variant NAME=K=V,K=V[:check]] ...

Without ``--variant`` a built-in list runs (profiling modes and producer variants).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
P = "SPARSE_MLA_GLUON_"
DEFAULT = [
    ("base", {}, True),
    ("producer-only", {P + "PROFILE": "1"}, False),
    ("consumer-only", {P + "PROFILE": "2"}, False),
    ("no-hbm-gather", {P + "PROFILE": "3"}, False),
    ("idx-prefetch", {P + "IDX_PREFETCH": "1"}, True),
]
CHECK_K = "matches_reference or topk_length_sink_nan or lonely or odd_page or partial_head"


def run_one(name, env_over, check, only, quick):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), **env_over)
    res = {"name": name, "env": env_over}
    if check:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                            os.path.join(ROOT, "tests", "test_gluon.py"), "-k", CHECK_K],
                           env=env, capture_output=True, text=True, cwd=ROOT)
        tail = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-300:]
        res["check"] = ("PASS " if r.returncode == 0 else "FAIL ") + tail
    code = (
        "import json,sys; sys.path.insert(0, %r); import bench_decode as bd;"
        "flts=[dict(kv.split('=') for kv in f.split(',')) for f in %r.split(';')];"
        "rows=[];"
        "[rows.append(bd.bench_shape(b,h,s,t,d,1.0,1.0,%r)) for (b,h,s,t,d,fm) in bd.SHAPES "
        " if any(all(str(dict(b=b,h_q=h,s_q=s,topk=t,d_qk=d).get(k))==v for k,v in flt.items()) for flt in flts)];"
        "print('JSON'+json.dumps(rows))"
    ) % (HERE, only, quick)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("JSON")]
    if r.returncode or not line:
        res["error"] = (r.stderr or r.stdout)[-1500:]
        res["rows"] = []
    else:
        res["rows"] = json.loads(line[0][4:])
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="b=64,h_q=128,d_qk=576",
                    help="shape filters: k=v,k=v (all must match); several filters separated by ';'")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=KNOB=V,KNOB=V[:check] (KNOB without the SPARSE_MLA_GLUON_ prefix)")
    ap.add_argument("--full", action="store_true", help="full repetitions (default quick)")
    ap.add_argument("--json")
    a = ap.parse_args()
    variants = []
    for v in a.variant:
        check = v.endswith(":check")
        v = v[:-6] if check else v
        name, _, rest = v.partition("=")
        env = {P + kv.split("=")[0]: kv.split("=")[1] for kv in rest.split(",") if kv}
        variants.append((name, env, check))
    variants = variants or DEFAULT
    out = []
    for name, env, check in variants:
        r = run_one(name, env, check, a.only, not a.full)
        out.append(r)
        us = ", ".join(f"b={x['b']} h_q={x['h_q']}: {x['us']:.1f} us" for x in r["rows"])
        print(f"{name:24s} {r.get('check', ''):40s} {us} {('ERROR ' + r['error'][-600:]) if 'error' in r else ''}",
              flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
