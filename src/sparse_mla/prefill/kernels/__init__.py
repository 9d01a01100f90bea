"""The prefill's kernels (they import Triton; the backends import them on first launch):
:mod:`.hopper` (the decode's Gluon kernel with one partition per query token) and :mod:`.portable`
(Triton ``tl``, any GPU and the interpreter)."""
