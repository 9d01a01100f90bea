"""Training benchmark: the sparse prefill's backward beside its forward, and the indexer's loss.

Rows (bf16 ``kv`` rows, d_qk 576, s_kv 32K, attn_sink on, random distinct top-k rows):

- ``forward``: ``flash_mla_sparse_fwd`` under ``torch.no_grad`` (the inference path);
- ``backward``: ``torch.autograd.grad`` of ``out`` for ``q``, ``kv`` and ``attn_sink`` (the
  backward kernel alone: the forward ran once before), and its ratio to the forward (target
  <= 2.5x);
- ``backward, shared keys``: every query token selects the same top-k rows, the worst case for
  the float32 atomics that accumulate ``dkv``;
- ``indexer_kl_loss`` forward + backward (dense warm-up: causal over every preceding token) at
  s 4096 / 8192, H 64, D 128, main attention h_q 128, at the default blocks and at 16x smaller ones.

Times: median µs of ``triton.testing.do_bench`` (eager; L2 flushed between calls).

    python -m benchmarks.training [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse

import torch

import sparse_mla as flash_mla

from . import harness

#: (s_q, h_q, topk) of the attention rows
ATTENTION_ROWS = [(4096, 128, 2048), (4096, 64, 2048)]
#: sequence lengths of the indexer loss rows
LOSS_ROWS = [4096, 8192]
#: (block_q, block_kv) of the indexer loss: the defaults (256 x 1024 x (128 + 64) fp32 scores,
#: 200 MB, at a time), and blocks 16x smaller (many more, smaller tensor ops)
LOSS_BLOCKS = [(256, 1024), (64, 256)]
S_KV = 32768


def attention_rows(s_q: int, h_q: int, topk: int, quick: bool) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = (torch.randn(s_q, h_q, 576, device="cuda", generator=g) / 4).to(torch.bfloat16).requires_grad_()
    kv = (torch.randn(S_KV, 1, 576, device="cuda", generator=g) / 4).to(torch.bfloat16).requires_grad_()
    sink = torch.randn(h_q, device="cuda", generator=g).requires_grad_()
    idx = torch.empty(s_q, 1, topk, dtype=torch.int32, device="cuda")
    for i in range(0, s_q, 256):
        n = min(256, s_q - i)
        idx[i : i + n, 0] = torch.rand(n, S_KV, device="cuda", generator=g).topk(topk, dim=1).indices.int()
    shared = idx[:1].expand(s_q, 1, topk).contiguous()
    scale = 576**-0.5

    with torch.no_grad():
        fwd = harness.median_us(lambda: flash_mla.flash_mla_sparse_fwd(q, kv, idx, scale, attn_sink=sink), quick)
    rows = [dict(row="forward", s_q=s_q, h_q=h_q, topk=topk, us=fwd)]
    for name, ind in (("backward", idx), ("backward, shared keys", shared)):
        out = flash_mla.flash_mla_sparse_fwd(q, kv, ind, scale, attn_sink=sink)[0]
        dout = torch.randn_like(out)
        us = harness.median_us(
            lambda out=out, dout=dout: torch.autograd.grad(out, (q, kv, sink), dout, retain_graph=True), quick
        )
        rows.append(dict(row=name, s_q=s_q, h_q=h_q, topk=topk, us=us, ratio_to_forward=us / fwd))
    return rows


def loss_row(s: int, blocks: tuple[int, int], quick: bool, heads: int = 64, dim: int = 128, h_q: int = 128) -> dict:
    g = torch.Generator(device="cuda").manual_seed(1)
    q_idx = torch.randn(s, heads, dim, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    k_idx = torch.randn(s, dim, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    w = torch.randn(s, heads, device="cuda", generator=g).requires_grad_()
    q = (torch.randn(s, h_q, 576, device="cuda", generator=g) / 4).to(torch.bfloat16)
    kv = (torch.randn(s, 1, 576, device="cuda", generator=g) / 4).to(torch.bfloat16)

    def step():
        loss = flash_mla.indexer_kl_loss(q_idx, k_idx, w, q, kv, 576**-0.5, block_q=blocks[0], block_kv=blocks[1])
        return torch.autograd.grad(loss, (q_idx, k_idx, w))

    us = harness.median_us(step, quick)
    return dict(row="indexer_kl_loss fwd+bwd (dense)", s=s, H=heads, D=dim, h_q=h_q, blocks=blocks, us=us)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--json", help="write the results here (default: benchmarks/results/<date>_<gpu>_training.json)")
    args = ap.parse_args(argv)
    if not harness.has_cuda("benchmarks.training"):
        return 2
    print(f"# {torch.cuda.get_device_name()}")
    rows = []
    for s_q, h_q, topk in ATTENTION_ROWS:
        for r in attention_rows(s_q, h_q, topk, args.quick):
            rows.append(r)
            ratio = f"  ({r['ratio_to_forward']:.2f}x forward)" if "ratio_to_forward" in r else ""
            print(f"{r['row']:>24}  s_q {s_q} h_q {h_q} topk {topk}: {r['us']:10.1f} us{ratio}", flush=True)
        torch.cuda.empty_cache()
    for s in LOSS_ROWS:
        for blocks in LOSS_BLOCKS:
            r = loss_row(s, blocks, args.quick)
            rows.append(r)
            print(f"{r['row']:>24}  s {s} H {r['H']} D {r['D']} blocks {blocks}: {r['us']:10.1f} us", flush=True)
            torch.cuda.empty_cache()
    print(f"wrote {harness.write_results('training', dict(rows=rows), args.json)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
