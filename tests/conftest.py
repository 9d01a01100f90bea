"""pytest configuration.

* Without CUDA, the kernels run under Triton's interpreter: ``TRITON_INTERPRET=1`` is set here,
  before anything imports Triton (Triton reads it when a kernel is defined), so plain
  ``python -m pytest`` tests the kernels on a CPU too. An explicit ``TRITON_INTERPRET=0`` is
  respected (the kernel tests then skip, and the report header says so).
* ``tests/helpers.py`` is importable as ``helpers`` in every import mode.
* ``@pytest.mark.gpu`` tests are skipped when CUDA is absent.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    if "triton" in sys.modules:  # too late: kernels defined now would be compiled ones
        raise pytest.UsageError(
            "triton was imported before tests/conftest.py could set TRITON_INTERPRET=1; "
            "run `TRITON_INTERPRET=1 python -m pytest`"
        )
    os.environ["TRITON_INTERPRET"] = "1"

if os.environ.get("TRITON_INTERPRET") == "1":
    # define every kernel module now, under the interpreter: a test that sets TRITON_INTERPRET=0
    # for a reference path (monkeypatch) must not be the first to import one (its kernels would
    # then be compiled ones, and every later interpreter test of that module would fail)
    import importlib

    for _mod in ("decode.kernels.portable", "decode.kernels.combine", "decode.kernels.schedule",
                 "prefill.kernels.portable", "indexer.kernels", "kvcache.kernels.store",
                 "kvcache.kernels.index_convert"):  # fmt: skip
        importlib.import_module(f"sparse_mla.{_mod}")


def pytest_addoption(parser):
    parser.addoption(
        "--hopper-config",
        default="",
        help="KEY=V,... HopperConfig fields made the Hopper kernel's default for this run (checking a "
        "variant on the GPU with the whole suite, e.g. half_stages=1)",
    )
    parser.addoption(
        "--all-flashmla-cases",
        action="store_true",
        help="run all 2016 cases of FlashMLA's dense decode matrix (GPU), not the default sample of 84",
    )


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """After each test on a GPU, the caching allocator's free blocks go back to the driver: the
    suite runs in several processes on one GPU, and a process that held a large test's memory
    would otherwise starve the others' large tests."""
    yield
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def pytest_configure(config):
    spec = config.getoption("--hopper-config")
    if spec:
        from benchmarks.variants import set_hopper_default

        set_hopper_default(spec)


def pytest_report_header(config):
    if torch.cuda.is_available():
        spec = config.getoption("--hopper-config")
        return f"sparse_mla kernels: compiled on {torch.cuda.get_device_name()}" + (
            f" (Hopper kernel default: {spec})" if spec else ""
        )
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "sparse_mla kernels: Triton interpreter on the CPU (TRITON_INTERPRET=1)"
    return (
        "sparse_mla kernels: NOT TESTED (no CUDA and TRITON_INTERPRET is not 1): "
        "kernel tests skip; unset TRITON_INTERPRET to run them under the interpreter"
    )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
