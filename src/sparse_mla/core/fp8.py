"""FP8 e4m3 bit helpers for Triton kernels: exact decode, round-to-nearest-even encode, and the
power-of-two scale exponent. Imports Triton: only kernel modules import it."""

import triton
import triton.language as tl

__all__ = ["e4m3_decode_exact", "e4m3_rtne_bits", "ceil_log2_div448"]


@triton.jit
def e4m3_decode_exact(b):
    """e4m3 bytes (any integer dtype) -> float32 by integer operations, exactly: sign and the 7 low
    bits placed into an fp16 (times 2^8 restores the exponent bias); 0x7F / 0xFF are NaN."""
    b = b.to(tl.int32)
    h = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.int16)
    x = h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where((b & 0x7F) == 0x7F, float("nan"), x)


@triton.jit
def e4m3_rtne_bits(y):
    """float32 ``y`` with ``|y| <= 448`` -> int32 e4m3fn byte (0..255), round-to-nearest-even."""
    u = y.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    e = a >> 23
    # normal e4m3 (|y| >= 2^-6, fp32 exponent field >= 121): keep 3 mantissa bits, rebias 127 -> 7
    nrm = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal e4m3: |y| = sig * 2^(e - 150), byte = round_half_even(sig * 2^(e - 141))
    sig = (a & 0x7FFFFF) | 0x800000
    sh = tl.minimum(141 - e, 31)
    sh = tl.maximum(sh, 1)  # (only matters for lanes that take the normal branch)
    qq = sig >> sh
    rem = sig - (qq << sh)
    half = 1 << (sh - 1)
    up = (rem > half) | ((rem == half) & ((qq & 1) == 1))
    sub = qq + up.to(tl.int32)
    sub = tl.where(e == 0, 0, sub)  # fp32 zero / subnormal: far below e4m3's 2^-9
    mag = tl.where(e >= 121, nrm, sub)
    return sign | mag


@triton.jit
def ceil_log2_div448(amax):
    """``ceil(log2(amax / 448))`` (int32) of positive normal float32 ``amax``, exactly, from its bits:
    ``amax = 1.m * 2^e`` gives ``amax / 448 = (1.m / 1.75) * 2^(e - 8)``, so the exponent is ``e - 8``,
    plus one when ``1.m > 1.75`` (mantissa field above ``0x600000``)."""
    bits = amax.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
