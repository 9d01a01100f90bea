"""Offline (no GPU): compile the register top-k (``_topk_bisect_kernel``, 32768 entries, k 2048, 16
warps, unsorted) for sm_90a and print its registers, spills and how many of a thread's row loads
are in flight before each of their first uses (the ``FADD`` of ``x + 0.0`` in ``_key32``): the
measure behind session 20's unmasked row loads.

    PYTHONPATH=src python scripts/topk_sass_loads.py [INSIDE=64] [PACK16=0] [SORTED=1] ...
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
import indexer_compile_check as cc  # noqa: E402
from sparse_mla.indexer import kernels as K  # noqa: E402


def main(argv: list[str]) -> int:
    consts = dict(
        N_P2=32768, BLOCK=2048, K_P2=2048, CAP=4096, THREADS=512, TIE_BITS=15, SLOTS=False, SORTED=False,
        FOR_LOOP=True, VEC=1, PACK16=True, STOP=0, INSIDE=64,
    )  # fmt: skip
    for a in argv:
        key, v = a.split("=")
        consts[key] = bool(int(v)) if isinstance(consts.get(key), bool) else int(v)
    k = cc.compile_one(K._topk_bisect_kernel, consts, 16, 90, {"out_ptr": "*i32"}, None)
    d = tempfile.mkdtemp(prefix="topk_sass_")
    ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
    with open(ptx, "w") as f:
        f.write(k.asm["ptx"])
    r = subprocess.run(
        [os.path.join(cc.BIN, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", cubin], capture_output=True, text=True
    )
    print(" ".join(re.findall(r"Used \d+ registers|\d+ bytes spill stores|\d+ bytes spill loads", r.stderr)))
    sass = subprocess.run([os.path.join(cc.BIN, "nvdisasm"), "-c", cubin], capture_output=True, text=True).stdout
    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", ln)]
    ldg = [i for i, ln in enumerate(lines) if "LDG" in ln]
    uses = [i for i, ln in enumerate(lines) if re.search(r"FADD R\d+, RZ", ln)][:64]
    depth = [sum(1 for i in ldg if i < u) - j for j, u in enumerate(uses)]
    print(f"{len(ldg)} LDG, {len(uses)} first uses; loads in flight at each use: {depth}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
