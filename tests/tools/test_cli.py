"""The command line: ``sparse-mla demo`` (run in a subprocess: the demo sets TRITON_INTERPRET), and
what a new user reads before it: the README's install steps, the dependencies, docs/design.md."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparse_mla.tools import cli, common

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, env_update: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update({"COLUMNS": "160", "NO_COLOR": "1"})
    env.update(env_update or {})
    return subprocess.run(
        [sys.executable, "-m", "sparse_mla", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


# facts of the walkthrough's worked example that the demo prints from the code
SEED_FACTS = [
    "d_qk",
    "576",
    "ue8m0",  # a. config
    "2^-9",
    "0x70",
    "0-511",
    "512-527",
    "528-655",
    "656",
    "584",  # b. one token
    "= 66",
    "payload = ceil(14 / 66) + 5 = 6",
    "num_splits = [0, 2, 4]",
    "partitions 4-65 idle",  # c.
    "[2, 1, 128, 512] bfloat16",
    "[2, 128, 1] float32",  # d. shapes
    "0.7579",
    "0.2333",
    "1.9911",
    "0.1353",  # e. combine
]


def _demo_in_process(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """``--reference`` runs change no environment variable for good, so they can run in-process."""
    monkeypatch.setenv("COLUMNS", "160")
    monkeypatch.setenv("NO_COLOR", "1")
    before = os.environ.get("TRITON_INTERPRET")
    rc = cli.main(["demo", "--reference", "--device", "cpu", *args])
    assert os.environ.get("TRITON_INTERPRET") == before
    return rc, capsys.readouterr().out


def test_demo_reference_passes_and_prints_the_seed_example(monkeypatch, capsys):
    rc, out = _demo_in_process(monkeypatch, capsys)
    assert rc == 0, out
    for fact in SEED_FACTS:
        assert fact in out, f"missing {fact!r} in the demo output:\n{out}"
    assert "PyTorch reference" in out and "PASS" in out
    # the four busy partitions of the walkthrough's table: begin/end req, begin/end block, split, flags
    rows = [line.split() for line in out.splitlines() if line.startswith("│") and line.count("│") == 9]
    busy = [[int(x) for x in row if x != "│"] for row in rows if all(x == "│" or x.isdigit() for x in row)]
    assert busy == [
        [0, 0, 0, 0, 1, 0, 0, 1],
        [1, 0, 0, 1, 2, 1, 1, 0],
        [2, 1, 1, 0, 1, 0, 0, 1],
        [3, 1, 1, 1, 2, 1, 1, 0],
    ]


def test_demo_seed_option_changes_the_inputs(monkeypatch, capsys):
    line = lambda s: next(x for x in s.splitlines() if x.startswith("out[0, 0, 0, :4]"))  # noqa: E731
    rc1, a = _demo_in_process(monkeypatch, capsys, "--seed", "1")
    rc2, b = _demo_in_process(monkeypatch, capsys, "--seed", "2")
    assert rc1 == 0 and rc2 == 0
    assert line(a) != line(b)


def test_python_dash_m_reference():
    r = _run("demo", "--reference", "--device", "cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout and "partitions 4-65 idle" in r.stdout


def test_demo_triton_interpreter_passes():
    r = _run("demo", "--device", "cpu", env_update={"TRITON_INTERPRET": "1"})
    assert "Triton interpreter on CPU" in r.stdout, r.stdout + r.stderr
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.gpu
def test_demo_cuda_passes():
    r = _run("demo", "--device", "cuda")
    assert "Triton kernels on CUDA" in r.stdout, r.stdout + r.stderr
    assert r.returncode == 0, r.stdout + r.stderr


def test_demo_without_kernels_says_so():
    code = (
        "import sys; sys.modules['sparse_mla.decode.kernels.portable'] = None\n"
        "from sparse_mla.tools.cli import main; sys.exit(main(['demo', '--device', 'cpu']))"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", NO_COLOR="1", COLUMNS="160")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Triton kernels are not available" in r.stdout and "--reference" in r.stdout


# a module hidden from a fresh interpreter, as after `pip install -e .` without it
_HIDE = "import sys; sys.modules[{mod!r}] = None\nfrom sparse_mla.tools.cli import main; sys.exit(main({argv!r}))"


def _run_hiding(mod: str, argv: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_COLOR="1", COLUMNS="200")
    env.pop("TRITON_INTERPRET", None)  # as a user runs it: the CLI sets it on the CPU
    code = _HIDE.format(mod=mod, argv=argv)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path (Triton's interpreter) needs NumPy")
def test_demo_without_numpy_says_numpy_and_exits_2():
    r = _run_hiding("numpy", ["demo", "--device", "cpu"])
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "numpy is not installed" in r.stdout and "Triton kernels are not available" in r.stdout
    header = r.stdout.splitlines()[0]
    assert "triton unavailable: numpy is not installed" in header, header
    assert "triton not installed" not in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path (Triton's interpreter) needs NumPy")
def test_serve_sim_without_numpy_says_numpy_and_exits_2():
    r = _run_hiding("numpy", ["serve-sim", "--device", "cpu", "--no-progress"])
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "numpy is not installed" in r.stderr, r.stderr
    assert r.stdout == "", r.stdout  # nothing ran


def test_demo_without_triton_says_triton():
    r = _run_hiding("triton", ["demo", "--device", "cpu"])
    assert r.returncode == 2, r.stdout + r.stderr
    assert "triton is not installed" in r.stdout and "triton unavailable" in r.stdout.splitlines()[0]


def test_describe_import_error():
    assert "numpy is not installed" in common.describe_import_error(ModuleNotFoundError("x", name="numpy"))
    assert "triton is not installed" in common.describe_import_error(ModuleNotFoundError("x", name="triton.language"))
    assert common.describe_import_error(ImportError("libfoo.so: cannot open")) == "ImportError: libfoo.so: cannot open"


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirement(reqs: list[str], name: str):
    from packaging.requirements import Requirement

    found = [Requirement(r) for r in reqs if Requirement(r).name == name]
    assert found, f"{name} is not among {reqs}"
    return found[0]


def test_numpy_is_a_runtime_dependency():
    """Triton's interpreter imports NumPy: a plain `pip install -e .` must bring it."""
    _requirement(_pyproject()["project"]["dependencies"], "numpy")


# what the CUDA builds of torch on PyPI pin (checked with pip's dry-run reports): torch -> triton
TORCH_TRITON = {
    "2.11.0": "3.6.0",
    "2.12.0": "3.7.0",
    "2.12.1": "3.7.1",
    "2.13.0": "3.7.1",
    "2.14.1": "3.8.0",
    "2.15.0": "3.9.0",
}


def test_requirements_admit_the_torch_and_triton_we_claim():
    deps = _pyproject()["project"]["dependencies"]
    torch_req, triton_req = _requirement(deps, "torch"), _requirement(deps, "triton")
    for tv, trv in TORCH_TRITON.items():
        assert torch_req.specifier.contains(tv), (torch_req, tv)
        assert triton_req.specifier.contains(trv), (triton_req, trv, f"what torch {tv} (CUDA) pins")


def _install_section() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("## Install", 1)[1].split("\n## ", 1)[0]


def test_readme_install_works_without_the_ci_pins():
    """The CPU install must not use .ci/constraints.txt (a CUDA torch + triton conflict off CI) and must
    take PyTorch's CPU build before the package."""
    commands = [
        line.strip()
        for block in re.findall(r"```bash\n(.*?)```", _install_section(), re.DOTALL)
        for line in block.splitlines()
        if line.strip().startswith("pip ")
    ]
    assert commands, _install_section()
    assert not any("constraints" in c or " -c " in c for c in commands), commands
    cpu = next(i for i, c in enumerate(commands) if "download.pytorch.org/whl/cpu" in c)
    assert commands[cpu].startswith("pip install torch ")
    assert any(c.startswith("pip install -e") for c in commands[cpu + 1 :]), commands
    assert "CI only" in (ROOT / ".ci" / "constraints.txt").read_text()


def test_no_unexplained_design_or_seed_references(monkeypatch, capsys):
    """`DESIGN §N` and `seed step N` pointed at files that are not in the repository."""
    rc, out = _demo_in_process(monkeypatch, capsys)
    assert rc == 0
    readme = (ROOT / "README.md").read_text()
    for text, where in ((out, "demo output"), (readme, "README")):
        assert "DESIGN §" not in text and not re.search(r"seed step", text, re.IGNORECASE), where
        assert "docs/design.md" in text, where
    assert "walkthrough step 3" in out and "FlashMLA's tolerances" in out


def test_design_doc_lists_the_walkthrough_steps_and_real_paths():
    doc = (ROOT / "docs" / "design.md").read_text()
    steps = [int(m) for m in re.findall(r"^\| (\d+) \|", doc, re.MULTILINE)]
    assert steps == list(range(20)), steps
    for sec in ("## 3.", "## 4.", "## 5.", "## 6."):  # the numbers code comments cite as "DESIGN §N"
        assert sec in doc
    paths = set(re.findall(r"`((?:[a-z]+/)*[a-z_]+\.py)`", doc))
    assert {
        "decode/scheduler.py",
        "formats/layouts.py",
        "decode/kernels/portable.py",
        "decode/kernels/combine.py",
    } <= paths
    for rel in paths:
        assert (ROOT / "src" / "sparse_mla" / rel).is_file(), rel


def test_parser():
    p = cli.build_parser()
    assert p.parse_args(["demo"]).command == "demo"
    a = p.parse_args(["demo", "--seed", "7", "--reference"])
    assert a.seed == 7 and a.reference and a.device == "auto"
    with pytest.raises(SystemExit) as e:
        p.parse_args([])  # a subcommand is required
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--version"])
    assert e.value.code == 0


def test_cuda_device_without_cuda_is_an_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--device", "cuda"])
    assert e.value.code == 2  # README: exit status 2 = kernels unavailable


def test_ranges():
    assert cli.format_ranges([4, 5, 6, 9, 11, 12]) == "4-6, 9, 11-12"
    assert cli.format_ranges([]) == ""


@pytest.mark.parametrize("command", ["demo", "serve-sim"])
@pytest.mark.parametrize("seed", ["99999999999999999999", "-1", "x"])
def test_bad_seed_is_a_usage_error_naming_it(command, seed, capsys, monkeypatch):
    # serve-sim chooses the interpreter for --device cpu before it checks the sizes: keep that
    # choice inside this test (a GPU host's later tests run compiled kernels in this process)
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    try:
        rc = cli.main([command, "--device", "cpu", "--seed", seed])
    except SystemExit as e:  # argparse's own usage error
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert "--seed" in err and "Traceback" not in err


def test_sizes_the_machine_cannot_allocate_exit_2_with_one_line(capsys):
    # (before: a DefaultCPUAllocator traceback and exit 1, the "check failed" status)
    # 30000 x 65536 tokens: 1.97e9 cache slots (int32 indices hold them), 1.2 TiB of V32 cache
    rc = cli.main(["serve-sim", "--batch", "30000", "--max-context", "65536", "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "sparse-mla serve-sim: cannot allocate the requested sizes" in err and "Traceback" not in err
    # the message says which sizes ask for the memory
    assert "the largest part: the paged V32 cache (batch 30000 x max_context 65536 in 30720000 pages" in err, err


def test_a_bad_backend_variable_exits_2_naming_it(monkeypatch, capsys):
    monkeypatch.setenv("SPARSE_MLA_BACKEND", "bogus")
    rc = cli.main(["demo", "--reference"])
    assert rc == 2
    assert "sparse-mla demo: error: SPARSE_MLA_BACKEND: expected 'auto' or one of" in capsys.readouterr().err
    monkeypatch.setenv("SPARSE_MLA_TRACEBACK", "1")  # the traceback on request
    with pytest.raises(ValueError, match="SPARSE_MLA_BACKEND"):
        cli.main(["demo", "--reference"])
