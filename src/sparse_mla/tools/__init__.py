"""Command-line tools: ``sparse-mla demo`` and ``sparse-mla serve-sim`` (:mod:`.cli`)."""
