"""The offline compile matrix (:mod:`sparse_mla.tools.targets`): every kernel family compiled for
every known target with its dispatcher's launch configuration, in a process without the
interpreter (one per target, so the workers spread them), and the checks on what came out."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from sparse_mla.core.target import INTERPRETER, TARGETS, device_target, dispatch_target, dispatching_as, pdl_enabled

DOC = Path(__file__).resolve().parents[2] / "docs" / "targets.md"
#: targets whose FP8 decode is the exact integer one (no e4m3 conversion instruction)
INTEGER_DECODE = tuple(n for n, t in TARGETS.items() if not t.fp8_convert)
#: NVIDIA targets without programmatic dependent launch
NO_PDL = ("sm_80", "sm_86", "sm_89")
#: the kernels of the portable decode and prefill (where the cache's e4m3 bytes are decoded)
FP8_DECODERS = ("_sparse_decode_kernel", "_sparse_prefill_kernel")


def test_dispatching_as_overrides_device_target_and_pdl():
    cpu = torch.device("cpu")
    assert dispatch_target() is None
    with dispatching_as("sm_90a") as t:
        assert device_target(cpu) is t and pdl_enabled(cpu)
        with dispatching_as(TARGETS["sm_80"]):
            assert device_target(cpu).name == "sm_80" and not pdl_enabled(cpu)
        assert dispatch_target() is t
    assert device_target(cpu) is INTERPRETER and dispatch_target() is None
    with pytest.raises(ValueError, match="target"):
        with dispatching_as("sm_70"):
            pass
    with pytest.raises(TypeError, match="t:"):
        with dispatching_as(90):  # type: ignore[arg-type]
            pass


def test_targets_subcommand_is_registered():
    from sparse_mla.tools.cli import build_parser

    a = build_parser().parse_args(["targets", "--target", "sm_80", "--json", "x.json"])
    assert a.target == ["sm_80"] and a.json == "x.json"


def _doc_claims(name: str) -> dict[str, str]:
    """The statuses docs/targets.md's table gives target ``name``, by operation."""
    text = DOC.read_text().splitlines()
    start = next(i for i, ln in enumerate(text) if ln.startswith("| operation |"))
    lines = []
    for ln in text[start:]:
        if not ln.startswith("|"):
            break
        if not ln.startswith("|---"):
            lines.append(ln)
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    col = head.index(name)
    return {c[0]: c[col] for c in ([x.strip() for x in ln.strip("|").split("|")] for ln in lines[1:])}


@pytest.mark.matrix
@pytest.mark.parametrize("name", list(TARGETS))
def test_compile_matrix(name):
    from sparse_mla.tools.targets import matrix_subprocess

    lines: list[str] = []
    r = matrix_subprocess([name], quick=True, timeout=900, progress=lines.append)["targets"][name]
    # one line as the target starts, one with its verdict
    assert len(lines) == 2 and lines[0].startswith(f"[1/1] {name}: compiling"), lines
    if r["toolchain"]:
        assert "no toolchain" in lines[1], lines
        pytest.skip(f"this Triton cannot compile for {name}: {r['toolchain']}")
    bad = sorted(op for op, c in r["operations"].items() if c["status"] != "compiled")
    assert lines[1].startswith(f"[1/1] {name}: " + ("all compiled" if not bad else "not compiled: " + ", ".join(bad)))
    t = TARGETS[name]
    ops = r["operations"]
    failing = {op: c["why"] for op, c in ops.items() if c["status"] == "fails"}
    assert not failing, failing
    # every cell the documented table says compiles does
    for op, claim in _doc_claims(name).items():
        if claim.rstrip("*") == "compiled":
            assert ops[op]["status"] == "compiled", (op, ops[op]["why"])
    for x in r["launches"]:
        if x["kernel"] == "(call)":
            assert "OutOfResources" in x["error"], x
            continue
        assert x["error"] is None, x
        assert x["refused"] or x["shared"] <= t.shared_bytes, x
        instr = x["instructions"]
        if name in NO_PDL:
            assert not instr.get("griddepcontrol"), x["kernel"]
        if x["kernel"] in FP8_DECODERS and name in INTEGER_DECODE:
            assert not instr.get("cvt.e4m3"), x["kernel"]
            assert not any(re.match(r"v_cvt_.*(fp8|bf8)", k) for k in instr), (x["kernel"], instr)
        assert t.hopper or "gluon" not in x["kernel"], x["kernel"]
