"""Context-parallel sparse decode over ``torch.distributed``: each rank holds a shard
of the cache, attends the indices it owns, and the partial results merge by their natural-log LSEs.

* :func:`merge_attention_states` — the pure merge (any device; twin :func:`merge_attention_states_reference`);
* :func:`sparse_decode_context_parallel` — the decode contract plus a process group.
"""

from .decode import localize_indices, sparse_decode_context_parallel
from .merge import merge_attention_states, merge_attention_states_reference

__all__ = [
    "merge_attention_states",
    "merge_attention_states_reference",
    "localize_indices",
    "sparse_decode_context_parallel",
]
