"""Context-parallel decode benchmark: b=64, s_q=2, h_q=128, topk 2048, 128K-token contexts, the cache
split over the ranks by page blocks; per step: the local decode, the all-gather + merge, the whole
call, against one GPU holding the whole cache (rank 0). Needs one GPU per rank:

    torchrun --nproc_per_node 2 -m benchmarks.distributed [--ctx 131072] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import sparse_mla as flash_mla
from sparse_mla.distributed import localize_indices, merge_attention_states, sparse_decode_context_parallel

from . import harness


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--b", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available() or "RANK" not in os.environ:
        print("benchmarks.distributed: run under torchrun with one CUDA device per rank", file=sys.stderr)
        return 2
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    s = harness.DecodeShape(a.b, 128, 2, 2048, 576, ctx=a.ctx)
    inp = harness.decode_inputs(s)  # same seed on every rank: the same global cache and indices
    nblk = inp.k_cache.shape[0]
    pbs = inp.k_cache.shape[1]
    blocks = [nblk * r // world for r in range(world + 1)]
    offsets = [bk * pbs for bk in blocks]
    shard = inp.k_cache[blocks[rank] : blocks[rank + 1]]
    idx = inp.index_sets[0]
    meta, _ = flash_mla.get_mla_metadata()

    def step():
        return sparse_decode_context_parallel(inp.q, shard, idx, offsets, tile_scheduler_metadata=meta)

    step()
    torch.cuda.synchronize()
    total = harness.median_us(step, a.quick)
    local_meta, _ = flash_mla.get_mla_metadata()
    local_idx = localize_indices(idx, offsets[rank], offsets[rank + 1])

    def local():
        return flash_mla.flash_mla_with_kvcache(
            inp.q, shard, None, None, 512, local_meta, is_fp8_kvcache=True, indices=local_idx
        )

    local_us = harness.median_us(local, a.quick)
    out, lse = local()
    part = torch.cat([out.float(), lse.permute(0, 2, 1).unsqueeze(-1)], dim=-1).contiguous()
    parts = torch.empty((world * part.shape[0], *part.shape[1:]), dtype=part.dtype, device=part.device)

    def gather_merge():
        dist.all_gather_into_tensor(parts, part)
        v = parts.view(world, *part.shape)
        return merge_attention_states(v[..., :512], v[..., 512].contiguous())

    merge_us = harness.median_us(gather_merge, a.quick)
    row = dict(rank=rank, world=world, b=a.b, ctx=a.ctx, total_us=total, local_us=local_us, gather_merge_us=merge_us)
    if rank == 0:
        one_meta, _ = flash_mla.get_mla_metadata()
        row["one_gpu_us"] = harness.median_us(
            lambda: flash_mla.flash_mla_with_kvcache(
                inp.q, inp.k_cache, None, None, 512, one_meta, is_fp8_kvcache=True, indices=idx
            ),
            a.quick,
        )
        row["merge_share"] = merge_us / total
        print(row, flush=True)
        harness.write_results("distributed", dict(row=row), a.json)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
