"""The README's examples run as they stand, on this machine: each ``python`` block in a fresh
process, with the PyTorch twins and under Triton's interpreter on a CPU (compiled on a GPU), well
inside a minute; the context-parallel one under ``torchrun`` with two processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
#: what a newcomer waits for one example on a CPU, at most
BUDGET_S = 60


def _env(interpret: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return env


def test_the_readme_has_its_examples():
    assert len(BLOCKS) >= 5
    assert "get_mla_metadata" in BLOCKS[0]  # the first example is the decode
    assert 'dev = "cuda" if torch.cuda.is_available() else "cpu"' in BLOCKS[0]  # and picks the device


@pytest.mark.parametrize("interpret", [False, True], ids=["twins", "interpreter"])
@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_example_runs(tmp_path, i, interpret):
    if interpret and torch.cuda.is_available():
        pytest.skip("on a GPU the examples run compiled (the twins case)")
    code = BLOCKS[i]
    path = tmp_path / f"example{i}.py"
    path.write_text(code)
    if "init_process_group" in code:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(path)]
    else:
        cmd = [sys.executable, str(path)]
    start = time.monotonic()
    r = subprocess.run(cmd, env=_env(interpret), capture_output=True, text=True, timeout=5 * BUDGET_S, cwd=tmp_path)
    took = time.monotonic() - start
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert took < BUDGET_S, f"example {i} took {took:.0f} s"
