"""``python -m sparse_mla demo``: the same command line as ``sparse-mla``."""

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
