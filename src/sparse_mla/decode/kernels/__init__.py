"""The decode's kernels (they import Triton; the backends import them on first launch):
:mod:`.hopper` (warp-specialised Gluon, sm_90), :mod:`.portable` (Triton ``tl``, any GPU and the
interpreter), :mod:`.combine` (the split-KV merge)."""
