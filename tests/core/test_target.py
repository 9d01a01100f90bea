"""The targets table and the per-device choice: which FP8 decode, dots, PDL, TMA and Hopper kernels
each GPU gets, and ``SPARSE_MLA_TARGET``'s emulation rules."""

from __future__ import annotations

import pytest
import torch

from sparse_mla.core.target import INTERPRETER, TARGETS, device_target, target


@pytest.mark.parametrize(
    "name, fp8_convert, pdl, hopper",
    [
        ("sm_80", False, False, False),  # Ampere: Triton refuses fp8e4nv below sm_89
        ("sm_86", False, False, False),
        ("sm_89", True, False, False),
        ("sm_90a", True, True, True),
        ("sm_100a", True, True, False),  # the Gluon kernels are sm_90 only
        ("sm_120", True, True, False),
        ("gfx90a", False, False, False),
        ("gfx942", False, False, False),  # FNUZ hardware: reading OCP bytes with it is wrong
        ("gfx950", False, False, False),  # Triton's e4m3 cast there reads NaN bytes as +-480
        ("gfx1100", False, False, False),
        ("gfx1201", False, False, False),
    ],
)
def test_each_target_decodes_fp8_as_its_hardware_allows(name, fp8_convert, pdl, hopper):
    t = target(name)
    assert (t.fp8_convert, t.pdl, t.hopper) == (fp8_convert, pdl, hopper)
    assert t.fp8_dot <= t.fp8_convert and t.tma == (t.vendor == "nvidia" and t.arch >= 90)
    assert t.triton_target().arch == t.arch
    assert t.warp_size == (64 if name in ("gfx90a", "gfx942", "gfx950") else 32)


def test_names_are_checked():
    assert target("sm_90") is target("SM_90A") is TARGETS["sm_90a"]
    assert target("interpreter") is INTERPRETER
    with pytest.raises(ValueError, match=r"^target: expected one of sm_80, .* got 'sm_75'"):
        target("sm_75")
    with pytest.raises(TypeError, match="^target: expected a str"):
        target(90)


def test_emulation_only_drops_features():
    h100 = target("sm_90a")
    a100 = target("sm_80").emulated_on(h100)
    assert a100.features() == target("sm_80").features() and a100.shared_bytes == target("sm_80").shared_bytes
    assert target("sm_89").emulated_on(h100).shared_bytes == 99 * 1024
    with pytest.raises(ValueError, match=r"^SPARSE_MLA_TARGET: sm_90a cannot be emulated on this sm_80 GPU \(no "):
        h100.emulated_on(target("sm_80"))
    with pytest.raises(ValueError, match=r"^SPARSE_MLA_TARGET: sm_80 cannot be emulated on this gfx942 GPU"):
        target("sm_80").emulated_on(target("gfx942"))


def test_cpu_tensors_take_the_interpreter_target():
    assert device_target(torch.device("cpu")) is INTERPRETER
    assert not INTERPRETER.fp8_convert  # its e4m3 cast reads NaN bytes as +-480


def test_portable_kernels_take_the_integer_decode_where_the_hardware_has_none():
    from sparse_mla.formats.gather import dot_consts

    assert dot_consts(target("sm_80"))["FP8_HW"] is False
    assert dot_consts(target("gfx942"))["FP8_HW"] is False
    assert dot_consts(target("sm_90a"))["FP8_HW"] is True
    assert dot_consts(target("gfx950"))["FP8_HW"] is False
    assert dot_consts(INTERPRETER) == dict(
        DOT_DTYPE=dot_consts(INTERPRETER)["DOT_DTYPE"], DOT_PREC="ieee", FP8_HW=False, FOR_LOOP=False
    )


@pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None, reason="needs an NVIDIA GPU")
def test_the_local_gpu_gets_its_capabilitys_features():
    from sparse_mla.core.target import emulated_target

    t = device_target(torch.device("cuda"))
    forced = emulated_target()
    if forced is not None:  # SPARSE_MLA_TARGET: that target's choices
        assert t.features() == forced.features()
        return
    cc = torch.cuda.get_device_capability()
    assert (t.fp8_convert, t.pdl, t.hopper) == (cc >= (8, 9), cc >= (9, 0), cc[0] == 9)
    assert t.shared_bytes == torch.cuda.get_device_properties(0).shared_memory_per_block_optin


def test_a_bad_sparse_mla_target_is_an_error_on_every_device(monkeypatch):
    import sparse_mla as flash_mla
    from sparse_mla.core import target as target_mod

    monkeypatch.setattr(target_mod, "_TARGET_ENV", "bogus")
    with pytest.raises(ValueError, match=r"^SPARSE_MLA_TARGET: expected one of sm_80, "):
        device_target(torch.device("cpu"))
    logits = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"^SPARSE_MLA_TARGET: expected one of"):
        flash_mla.topk_indices(logits, 3)  # (the reference twin would serve it on a CPU)
    monkeypatch.setattr(target_mod, "_TARGET_ENV", "auto")
    assert flash_mla.topk_indices(logits, 3).shape == (2, 3)


def test_the_table_is_read_only_and_takes_rocminfo_names():
    with pytest.raises(TypeError):
        TARGETS["sm_75"] = TARGETS["sm_80"]  # type: ignore[index]
    assert target("gfx942:sramecc+:xnack-") is TARGETS["gfx942"]
    with pytest.raises(TypeError, match="^device: expected a torch.device"):
        device_target("cpu")  # type: ignore[arg-type]
