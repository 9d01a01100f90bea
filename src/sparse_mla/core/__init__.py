"""What every operation shares, importing no operation: the environment and device queries
(:mod:`.env`), argument and storage checks (:mod:`.checks`) and, under ``torch.compile``, the
argument errors raised as the library's own exceptions (:mod:`.traced`), the backend protocol and ``backend=``
resolution (:mod:`.backend`), and, for kernel modules only (they import Triton), the FP8 bit
helpers (:mod:`.fp8`), the paging helpers (:mod:`.paging`) and the direct kernel launcher
(:mod:`.launcher`). Importing this package imports no Triton."""
