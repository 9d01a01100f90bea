"""The direct launch path runs only with the Triton releases it was tested with: any other release
takes Triton's public ``kernel[grid](...)`` path for every launch, with the same arguments."""

from __future__ import annotations

import pytest

from sparse_mla.core import launcher


class _Kernel:
    """A jit function's launch surface: records ``kernel[grid](...)`` calls."""

    arg_names = ("x", "N")

    def __init__(self) -> None:
        self.calls: list = []

    def __getitem__(self, grid):
        def go(*args, **kw):
            self.calls.append((grid, args, kw))

        return go


@pytest.fixture
def on_gpu(monkeypatch):
    """The launcher as it sees a GPU: compiled kernels, no launch hook, device 0."""
    monkeypatch.setattr(launcher, "interpreting", lambda: False)
    monkeypatch.setattr(launcher, "_hooks_installed", lambda: False)
    monkeypatch.setattr(launcher, "_CACHE", {})
    monkeypatch.setattr(launcher.torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv("SPARSE_MLA_DIRECT_LAUNCH", raising=False)
    launcher._triton_tested.cache_clear()
    yield
    launcher._triton_tested.cache_clear()


@pytest.mark.parametrize("version", ["3.7.0", "3.6.1", "3.8.0+git1234", "4.0.0"])
def test_an_untested_triton_takes_the_public_launch_path(on_gpu, monkeypatch, version):
    import triton

    monkeypatch.setattr(triton, "__version__", version)
    assert not launcher.direct_launch_enabled()
    k = _Kernel()
    for _ in range(3):
        launcher.launch(k, (2, 1, 1), (7,), {"N": 3}, {"num_warps": 4})
    # every launch through kernel[grid](...), none remembered for the direct path
    assert k.calls == [((2, 1, 1), (7,), {"N": 3, "num_warps": 4})] * 3
    assert launcher._CACHE == {}


def test_the_tested_triton_gets_the_direct_path(on_gpu, monkeypatch):
    import triton

    monkeypatch.setattr(triton, "__version__", launcher.DIRECT_LAUNCH_TRITON[0])
    assert launcher.direct_launch_enabled()
    monkeypatch.setenv("SPARSE_MLA_DIRECT_LAUNCH", "0")
    assert not launcher.direct_launch_enabled()


def test_the_launcher_reads_no_private_attributes():
    import inspect

    src = inspect.getsource(launcher)
    assert "os.environ._data" not in src and "torch._C." not in src


def test_launch_fitting_lowers_stages_then_halves_the_tile(monkeypatch):
    """A variant that does not fit in shared memory: stages down to one, then the named tile side
    halved and every stage count again, down to its smallest tile; what fits is remembered, and
    past the smallest the error stands."""
    import triton

    budget = 100 * 1024
    tried = []

    def fake_launch(kernel, grid, args, consts, opts):
        need = consts["NUM_STAGES"] * consts["BLOCK_N"] * 1024 * 2  # 2 KB a token a stage
        need += 64 * 1024 * (consts["NUM_STAGES"] == 1)  # (one stage: a layout conversion's scratch)
        tried.append((consts["NUM_STAGES"], consts["BLOCK_N"]))
        if need > budget:
            raise triton.runtime.errors.OutOfResources(need, budget, "shared memory")

    monkeypatch.setattr(launcher, "launch", fake_launch)
    monkeypatch.setattr(launcher, "_STAGE_CAP", {})
    kernel = object()
    launcher.launch_fitting(kernel, (1, 1, 1), (), {"BLOCK_N": 128}, 4, 3, "v", shrink=("BLOCK_N", 16))
    # (one stage at 32 needs 128 KB with the scratch; three stages at 16 fit in 96 KB)
    assert tried == [(3, 128), (2, 128), (1, 128), (3, 64), (2, 64), (1, 64), (3, 32), (2, 32), (1, 32), (3, 16)]
    tried.clear()
    launcher.launch_fitting(kernel, (1, 1, 1), (), {"BLOCK_N": 128}, 4, 3, "v", shrink=("BLOCK_N", 16))
    assert tried == [(3, 16)]  # remembered
    with pytest.raises(triton.runtime.errors.OutOfResources):
        launcher.launch_fitting(kernel, (1, 1, 1), (), {"BLOCK_N": 128}, 4, 2, "w", shrink=("BLOCK_N", 64))
    tried.clear()
    with pytest.raises(triton.runtime.errors.OutOfResources):  # nothing to shrink: stages only
        launcher.launch_fitting(kernel, (1, 1, 1), (), {"BLOCK_N": 128}, 4, 2, "x")
    assert tried == [(2, 128), (1, 128)]
