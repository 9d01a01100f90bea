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
