#!/usr/bin/env bash
# PDL on/off on the H200 (session 17): GPU tests, then benchmarks.host twice and benchmarks.decode at b=1/2/148
# with SPARSE_MLA_PDL=1 and 0 alternating; logs and JSON under $OUT (or ./gpu_out).
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
set -uo pipefail
export PYTHONPATH="$PWD/src:$PWD" PYTHONUNBUFFERED=1
L=$OUT/pdl.log
echo "== GPU tests (PDL on)" | tee $L
timeout 400 python3 -m pytest -q -p no:cacheprovider -x tests/test_gluon.py tests/test_host_path.py tests/test_kernels.py tests/test_workspace.py -rf 2>&1 | tail -3 | tee -a $L
for r in 1 2; do for pdl in 1 0; do
echo "== host, SPARSE_MLA_PDL=$pdl run $r" | tee -a $L
SPARSE_MLA_PDL=$pdl timeout 60 python3 -m benchmarks.host --quick --json $OUT/host_pdl${pdl}_$r.json 2>&1 | grep -v Warning | tail -5 | tee -a $L
done; done
for pdl in 1 0; do
echo "== decode b=148, SPARSE_MLA_PDL=$pdl" | tee -a $L
SPARSE_MLA_PDL=$pdl timeout 60 python3 -m benchmarks.decode --quick --only "b=148,d_qk=576;b=1;b=2" --json $OUT/decode_pdl${pdl}.json 2>&1 | grep -v Warning | tail -6 | tee -a $L
done
