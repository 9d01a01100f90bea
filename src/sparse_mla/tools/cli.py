"""Command line of sparse_mla: ``sparse-mla demo`` and ``sparse-mla serve-sim``.

Subcommands live in :data:`COMMANDS`. ``demo`` walks the worked example of the FlashMLA sparse
decode walkthrough end to end, every number coming from the library's code (the walkthrough's
numbered steps, and where each lives in this code, are listed in ``docs/design.md``):

a. the DeepSeek-V3.2 attention config and the kernel's dimensions (walkthrough step 0);
b. one token quantised into its 656-byte V32 record, and the MODEL1 layout's size (step 4);
c. the tile scheduler's partitions for 132 SMs, b=2, s_q=1, h_q=128, topk=128 (step 3);
d. a sparse decode through :func:`sparse_mla.flash_mla_with_kvcache`, checked against the fp32
   reference with FlashMLA's own test tolerances (docs/design.md, section 6);
e. the combine step's weights for split LSEs 4.2, 3.8, 2.1, log2 space (step 16).

Exit status: 0 when every check of (d) passes, 1 when one fails, 2 when the decode could not
run (the Triton kernels cannot be imported -- the message says why -- or ``--device cuda``
without CUDA; ``--reference`` runs the PyTorch path instead) and for usage errors.

The Triton interpreter must be chosen before Triton compiles anything, so this module imports
nothing from Triton or the kernel modules at import time; ``demo`` sets ``TRITON_INTERPRET=1``
(unless already set) before the first kernel module is imported when it runs on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .common import kernel_import_error, quiet_interpreter, triton_version

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from rich.console import Console

__all__ = ["main", "build_parser", "COMMANDS", "format_ranges"]

# the walkthrough's worked example (docs/design.md: section 5, walkthrough steps 0-3)
SEED_B, SEED_S_Q, SEED_H_Q, SEED_TOPK, SEED_PAGE_BLOCK = 2, 1, 128, 128, 64
SEED_NUM_SMS = 132
SEED_NUM_BLOCKS = 160  # 10,240 cache slots: the walkthrough's indices go up to token 8821
SEED_COMBINE_LSE = (4.2, 3.8, 2.1)

# FlashMLA's test tolerances against the fp32 reference (docs/design.md, section 6)


#: where the walkthrough's step numbers and the tolerances are explained (shipped in the repository)
DESIGN_DOC = "docs/design.md"


# --------------------------------------------------------------------------------------------
# helpers


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    """Set an environment variable for the duration of a block, then restore it."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _make_console() -> Console:
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal and console.width < 110:  # pipes and CI logs: rich assumes 80
        console = Console(highlight=False, width=110)
    return console


def _hex(b: Sequence[int]) -> str:
    return " ".join(f"{int(x):02x}" for x in b)


def _pow2(x: float) -> str:
    """``2^-9`` for 0.001953125 (x must be a power of two)."""
    import math

    m, e = math.frexp(x)
    return f"2^{e - 1}" if m == 0.5 else f"{x:g}"


def format_ranges(ids: Sequence[int]) -> str:
    """``[4, 5, 6, 9]`` -> ``"4-6, 9"``."""
    out: list[str] = []
    start = prev = None
    for i in ids:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = i
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ", ".join(out)


# --------------------------------------------------------------------------------------------
# demo sections


def _section_config(console: Console) -> None:
    from rich.table import Table

    from ..formats import V32

    console.rule("[bold]a. DeepSeek-V3.2 attention config -> kernel dimensions (walkthrough step 0, docs/design.md)")
    t = Table(show_lines=False)
    t.add_column("config.json")
    t.add_column("value", justify="right")
    t.add_column("kernel")
    t.add_column("value", justify="right")
    t.add_column("note")
    t.add_row("kv_lora_rank", "512", "d_nope", str(V32.d_nope), "latent NoPE part, stored as FP8")
    t.add_row("kv_lora_rank", "512", "d_v", str(V32.d_v), "V = the first 512 dims of K")
    t.add_row("qk_rope_head_dim", "64", "d_rope", str(V32.d_rope), "RoPE part, kept in bf16")
    t.add_row("512 + 64", "576", "d_qk", str(V32.d_qk), "Q/K head dim")
    t.add_row("num_attention_heads", "128", "h_q", "128", "query heads")
    t.add_row("num_key_value_heads", "128", "h_kv", "1", "MLA: one shared latent KV head (MQA)")
    t.add_row("index_topk", "2048", "topk", "2048", "keys per query (the demo uses 128)")
    t.add_row("quantization_config.fmt", '"e4m3"', "dtype", "float8_e4m3fn", "NoPE values, max 448")
    t.add_row("quantization_config.scale_fmt", '"ue8m0"', "scales", "UE8M0", "powers of two: exact dequant")
    console.print(t)


def _section_token(console: Console, seed: int) -> None:
    import torch
    from rich.table import Table

    from ..formats import MODEL1, V32, dequantize_k_cache, quantize_k_cache

    console.rule("[bold]b. One token in the FP8 cache: V32 layout, 656 bytes (walkthrough step 4)")
    g = torch.Generator().manual_seed(seed)
    tok = torch.empty(V32.d_qk)
    # tile 0 as in the walkthrough: [0.25, -0.5, 0.125, 0.75, ...] with max |x| = 0.75
    tok[0:128] = (torch.rand(128, generator=g) * 2 - 1) * 0.7
    tok[0:4] = torch.tensor([0.25, -0.5, 0.125, 0.75])
    for t_i, amax in ((1, 3.0), (2, 100.0), (3, 0.01)):  # other tiles: other scales, one below the floor
        lo = 128 * t_i
        tok[lo : lo + 128] = (torch.rand(128, generator=g) * 2 - 1) * amax * 0.9
        tok[lo + 5] = -amax
    tok[512:] = torch.randn(64, generator=g) * 0.2
    tok[512:515] = torch.tensor([0.1, -0.2, 0.3])
    k = tok.to(torch.bfloat16).view(1, 1, 1, V32.d_qk)
    kq = quantize_k_cache(k, "V32")
    raw = kq.view(torch.uint8)[0, 0, 0]
    assert raw.numel() == V32.bytes_per_token
    scales = raw[V32.scale_offset : V32.scale_offset + 16].clone().view(torch.float32)
    console.print(
        f"quantize_k_cache(k [1, 1, 1, 576] bf16, 'V32') -> {list(kq.shape)} {str(kq.dtype).replace('torch.', '')}"
    )

    t = Table(title="per-tile scales (read back from bytes 512-527)")
    t.add_column("tile")
    t.add_column("dims")
    t.add_column("max |x|", justify="right")
    t.add_column("max |x| / 448", justify="right")
    t.add_column("scale = 2^ceil(log2(max(., 1e-4)))", justify="right")
    t.add_column("bytes (float32 LE)")
    kf = k.float().view(-1)
    for i in range(V32.num_tiles):
        amax = kf[i * 128 : (i + 1) * 128].abs().max().item()
        sc = scales[i].item()
        t.add_row(
            str(i),
            f"{i * 128}-{i * 128 + 127}",
            f"{amax:g}",
            f"{amax / 448:.6f}",
            f"{_pow2(sc)} = {sc:.9g}" + ("  (1e-4 floor)" if amax / 448 < 1e-4 else ""),
            _hex(raw[512 + 4 * i : 516 + 4 * i].tolist()),
        )
    console.print(t)

    x0 = kf[0].item()
    b0 = int(raw[0])
    stored = raw[0:1].clone().view(torch.float8_e4m3fn).float().item()
    deq = dequantize_k_cache(kq, "V32", dtype=torch.float32).view(-1)
    console.print(
        f"element 0: x = {x0:g}, x / scale = {x0:g} / {_pow2(scales[0].item())} = {x0 / scales[0].item():g}"
        f" -> e4m3 {stored:g} = byte 0x{b0:02x} (sign 0, exponent {b0 >> 3 & 0xF} - 7 = {(b0 >> 3 & 0xF) - 7},"
        f" mantissa {b0 & 7}); dequantised {stored:g} x {_pow2(scales[0].item())} = {deq[0].item():g}"
    )

    t = Table(title="the 656-byte record")
    t.add_column("bytes")
    t.add_column("size", justify="right")
    t.add_column("content")
    t.add_column("first bytes (hex)")
    rope_hex = _hex(raw[V32.rope_offset : V32.rope_offset + 6].tolist())
    t.add_row(
        f"0-{V32.d_nope - 1}",
        str(V32.d_nope),
        "512 x float8_e4m3 NoPE values (x / scale of their tile)",
        _hex(raw[0:6].tolist()) + " ...",
    )
    t.add_row(
        f"{V32.scale_offset}-{V32.scale_offset + 15}",
        "16",
        "4 x float32 scales, one per 128 values",
        _hex(raw[512:518].tolist()) + " ...",
    )
    t.add_row(
        f"{V32.rope_offset}-{V32.bytes_per_token - 1}",
        str(2 * V32.d_rope),
        "64 x bfloat16 RoPE values (not quantised)",
        rope_hex + " ...",
    )
    t.add_row("total", str(V32.bytes_per_token), "vs 1152 B as 576 x bf16", "")
    console.print(t)
    nope_err = (deq[:512] - kf[:512]).abs().view(4, 128).amax(-1) / kf[:512].abs().view(4, 128).amax(-1)
    console.print(
        f"round trip: dequantize_k_cache gives max |error| / max |x| per tile = "
        f"[{', '.join(f'{e:.4f}' for e in nope_err.tolist())}] (e4m3 keeps 3 mantissa bits: <= 2^-4);"
        f" RoPE bits identical: {bool(torch.equal(deq[512:], kf[512:]))}"
    )

    # MODEL1: the same token's first 448 NoPE dims + RoPE
    k1 = torch.cat([k.view(-1)[: MODEL1.d_nope], k.view(-1)[V32.d_nope :]]).view(1, 1, 1, MODEL1.d_qk)
    kq1 = quantize_k_cache(k1, "MODEL1")
    blk = kq1.view(torch.uint8).as_strided((MODEL1.block_bytes(1),), (1,))
    e8 = int(blk[MODEL1.data_bytes])
    console.print(
        f"MODEL1 layout (d_qk {MODEL1.d_qk}): {MODEL1.bytes_per_token} B/token = {MODEL1.d_nope} e4m3 NoPE"
        f" ({MODEL1.num_tiles} tiles of {MODEL1.tile}) + {2 * MODEL1.d_rope} B bf16 RoPE"
        f" + {MODEL1.num_tiles} float8_e8m0 scales + 1 pad byte.\nA MODEL1 page block keeps all {MODEL1.data_bytes}-byte"
        f" \\[nope | rope] records first, then the scale bytes, padded to a multiple of {MODEL1.data_bytes} B"
        f" ({SEED_PAGE_BLOCK} tokens: {SEED_PAGE_BLOCK * MODEL1.bytes_per_token} -> {MODEL1.block_bytes(SEED_PAGE_BLOCK)} B)."
        f"\nThis token (first 448 NoPE dims + RoPE) as MODEL1: tile-0 scale e8m0 byte 0x{e8:02x} = 2^({e8} - 127) = 2^{e8 - 127}."
    )


def _section_schedule(console: Console) -> Any:
    from rich.table import Table

    from ..decode.scheduler import (
        FIXED_OVERHEAD_NUM_BLOCKS,
        META_FIELDS,
        batch_num_blocks,
        compute_num_sm_parts,
        schedule,
    )
    from ..decode.scheduler import small_head_tile as heads_per_cta

    b, s_q, h_q, topk = SEED_B, SEED_S_Q, SEED_H_Q, SEED_TOPK
    console.rule(
        f"[bold]c. Tile scheduler: {SEED_NUM_SMS} SMs, b={b}, s_q={s_q}, h_q={h_q}, topk={topk} (walkthrough step 3)"
    )
    hpc = heads_per_cta(h_q)
    parts = compute_num_sm_parts(SEED_NUM_SMS, s_q, h_q, hpc)
    main_blocks, num_blocks = batch_num_blocks(b, topk)
    table = schedule(num_blocks, parts, main_blocks=main_blocks)
    total = sum(n + FIXED_OVERHEAD_NUM_BLOCKS for n in num_blocks)
    console.print(
        f"num_sm_parts = max({SEED_NUM_SMS} // s_q // ceil(h_q / {hpc}), 1) = {parts}\n"
        f"blocks per batch = ceil(topk / 64) = {num_blocks}, plus {FIXED_OVERHEAD_NUM_BLOCKS} of fixed overhead each\n"
        f"total = {' + '.join(f'({n} + {FIXED_OVERHEAD_NUM_BLOCKS})' for n in num_blocks)} = {total}"
        f"\npayload = ceil({total} / {parts}) + {FIXED_OVERHEAD_NUM_BLOCKS} = {table.payload}"
    )
    t = Table()
    t.add_column("partition", justify="right")
    fields = [f for f in META_FIELDS if f != "pad"]
    for f in fields:  # two-line headers keep the table inside 110 columns
        t.add_column(f.replace("_req_", "_req_\n"), justify="right")
    idle = []
    for i, row in enumerate(table.rows()):
        if row["begin_req"] > row["end_req"]:
            idle.append(i)
            continue
        t.add_row(str(i), *(str(row[f]) for f in fields))
    console.print(t)
    console.print(
        f"partitions {format_ranges(idle)} idle (begin_req = b = {b});  num_splits = {table.num_splits.tolist()}"
        "  (batch i's partial results: rows num_splits\\[i] .. num_splits\\[i+1]-1)"
    )
    split = [i for i in range(b) if table.num_splits[i + 1] - table.num_splits[i] > 1]
    if split:
        console.print(
            f"[dim]batches {split} are split, so the combine step runs (the walkthrough's step 16 says this example "
            f"has one split per batch; its step 3, like this table, gives two).[/dim]"
        )
    return table


def _section_decode(console: Console, args: argparse.Namespace, device: torch.device, sched_table: Any) -> int:
    import torch
    from rich.table import Table

    from ..api import flash_mla_with_kvcache, get_mla_metadata
    from ..formats import quantize_k_cache
    from ..reference import sparse_decode_reference, sparse_decode_split_reference
    from ..testing import FLASHMLA_DECODE, cos_diff, decode_closeness

    b, s_q, h_q, topk, pbs = SEED_B, SEED_S_Q, SEED_H_Q, SEED_TOPK, SEED_PAGE_BLOCK
    d_qk, d_v = 576, 512
    console.rule(
        f"[bold]d. Sparse decode: b={b}, s_q={s_q}, h_q={h_q}, topk={topk}, page_block_size={pbs}, d_qk={d_qk}"
    )

    # which path runs: the interface takes Triton on CUDA, and on the CPU iff TRITON_INTERPRET=1
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if args.reference:
        path = "PyTorch reference (split-KV twin: sparse_decode_split_reference)"
    elif device.type == "cuda":
        path = "Triton kernels on CUDA"
    elif interp:
        path = "Triton interpreter on CPU (TRITON_INTERPRET=1)"
    else:
        path = "PyTorch reference (split-KV twin), because TRITON_INTERPRET is set to something other than 1"
    uses_triton = not args.reference and (device.type == "cuda" or interp)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    console.print(f"path: [bold]{path}[/bold]    device: [bold]{device}[/bold] ({dev_name})")

    if uses_triton:
        why = kernel_import_error()
        if why is not None:
            from rich.markup import escape

            console.print(
                f"[bold red]error:[/bold red] the Triton kernels are not available: {escape(why)}; "
                "run `sparse-mla demo --reference` for the PyTorch path."
            )
            return 2

    # inputs: made on the CPU from --seed (the same numbers on any device), then moved
    g = torch.Generator().manual_seed(args.seed)
    n_tok = SEED_NUM_BLOCKS * pbs
    q = torch.randn(b, s_q, h_q, d_qk, generator=g).to(torch.bfloat16)
    k_bf16 = torch.randn(SEED_NUM_BLOCKS, pbs, 1, d_qk, generator=g).to(torch.bfloat16)
    indices = torch.stack([torch.randperm(n_tok, generator=g)[:topk] for _ in range(b * s_q)])
    indices = indices.view(b, s_q, topk).to(torch.int32)
    q, k_bf16, indices = q.to(device), k_bf16.to(device), indices.to(device)
    k_cache = quantize_k_cache(k_bf16, "V32")
    console.print(
        f"q {list(q.shape)} bf16 (randn, seed {args.seed});  k_cache {list(k_cache.shape)} "
        f"{str(k_cache.dtype).replace('torch.', '')} ({SEED_NUM_BLOCKS} blocks, quantize_k_cache of randn bf16);  "
        f"indices {list(indices.shape)} int32, distinct, in [0, {n_tok})"
    )

    sched_meta, _ = get_mla_metadata(num_sms=SEED_NUM_SMS)
    if args.reference and device.type == "cuda":
        # the API always runs the kernels on CUDA: call the reference twin with the same schedule
        console.print(
            "call: sparse_decode_split_reference(q, k_cache, indices, <table c>)  "
            "[dim](flash_mla_with_kvcache always takes the kernels on CUDA)[/dim]"
        )
        o32, lse = sparse_decode_split_reference(q, k_cache, indices, sched_table.to(device), d_qk**-0.5, d_v)
        out = o32.to(torch.bfloat16)
    else:
        console.print(
            f"call: flash_mla_with_kvcache(q, k_cache, None, None, head_dim_v={d_v}, "
            f"tile_scheduler_metadata=get_mla_metadata(num_sms={SEED_NUM_SMS})[0], is_fp8_kvcache=True, indices=indices)"
        )
        ctx = _env("TRITON_INTERPRET", "0") if (args.reference and device.type == "cpu") else contextlib.nullcontext()
        with ctx, quiet_interpreter():
            out, lse = flash_mla_with_kvcache(
                q,
                k_cache,
                None,
                None,
                head_dim_v=d_v,
                tile_scheduler_metadata=sched_meta,
                is_fp8_kvcache=True,
                indices=indices,
            )
    if device.type == "cuda":
        torch.cuda.synchronize(device)

    ref_out, ref_lse = sparse_decode_reference(q, k_cache, indices, d_qk**-0.5, d_v)

    checks: list[tuple[str, str, str, bool | None]] = []  # (what, value, bound, ok; None = info)
    want_out, want_lse = (b, s_q, h_q, d_v), (b, h_q, s_q)
    checks.append(
        (
            "out shape / dtype",
            f"{list(out.shape)} {str(out.dtype).replace('torch.', '')}",
            f"{list(want_out)} bfloat16",
            tuple(out.shape) == want_out and out.dtype == torch.bfloat16,
        )
    )
    checks.append(
        (
            "lse shape / dtype",
            f"{list(lse.shape)} {str(lse.dtype).replace('torch.', '')}",
            f"{list(want_lse)} float32",
            tuple(lse.shape) == want_lse and lse.dtype == torch.float32,
        )
    )
    if tuple(out.shape) == want_out and tuple(lse.shape) == want_lse:
        tol = FLASHMLA_DECODE
        c = decode_closeness(out, lse, ref_out, ref_lse, tol)
        o, r = out.double(), ref_out.double()
        cos_sim = (o * r).sum().item() / max((o.norm() * r.norm()).item(), 1e-300)
        checks.append(
            (
                "out max |Δ|",
                f"{c.out_max_abs_err:.3e}",
                f"{tol.out_abs:g} + {tol.out_rel * 128:g}/128·|ref| (elementwise)",
                c.out_within,
            )
        )
        checks.append(("out cosine similarity", f"{cos_sim:.9f}", "", None))
        checks.append(
            ("out cosine distance", f"{c.out_cos_dist:.3e}", f"1 − 2Σxy/Σ(x²+y²) ≤ {tol.out_cos:g}", c.cos_within)
        )
        checks.append(
            (
                "lse max |Δ|",
                f"{c.lse_max_abs_err:.3e}",
                f"{tol.lse_abs:g} + {tol.lse_rel * 65536:g}/65536·|ref| (elementwise)",
                c.lse_within,
            )
        )
    if not (args.reference and device.type == "cuda"):
        same = (
            sched_meta.tile_scheduler_metadata is not None
            and torch.equal(sched_meta.tile_scheduler_metadata.cpu(), sched_table.metadata)
            and torch.equal(sched_meta.num_splits.cpu(), sched_table.num_splits)
        )
        checks.append(("schedule used = table c", "yes" if same else "no", "", same))

    t = Table(title="against reference.sparse_decode_reference (fp32, same dequantised cache)")
    t.add_column("check")
    t.add_column("value", justify="right")
    t.add_column("bound (FlashMLA's tolerances)")
    t.add_column("")
    for what, val, bnd, ok in checks:
        t.add_row(what, val, bnd, "" if ok is None else "[green]ok[/green]" if ok else "[red]FAIL[/red]")
    console.print(t)
    if tuple(out.shape) == want_out and tuple(lse.shape) == want_lse:
        floor_cd = cos_diff(ref_out.to(torch.bfloat16), ref_out)
        console.print(
            f"[dim]for scale: rounding the exact result to bf16 (to nearest even) alone gives cosine distance "
            f"{floor_cd:.3e}.[/dim]"
        )
        head = ", ".join(f"{v:.4f}" for v in out[0, 0, 0, :4].float().tolist())
        console.print(
            f"out[0, 0, 0, :4] = [{head}, ...]   lse[0, 0, 0] = {lse[0, 0, 0].item():.4f}  "
            "[dim](walkthrough step 19 prints 0.1931, ... / 4.538 for its own inputs)[/dim]"
        )
    passed = all(ok is not False for *_, ok in checks)
    console.print("[bold green]PASS[/bold green]" if passed else "[bold red]FAIL[/bold red]")
    return 0 if passed else 1


def _section_combine(console: Console) -> None:
    import torch
    from rich.table import Table

    from ..reference import LOG2E, combine_weights

    console.rule("[bold]e. Combine: merging 3 splits by their log2-space LSE (walkthrough step 16)")
    lse2 = torch.tensor(SEED_COMBINE_LSE, dtype=torch.float64)
    w, tot = combine_weights(lse2)
    m = lse2.max().item()
    t = Table()
    t.add_column("split", justify="right")
    t.add_column("lse_accum (log2)", justify="right")
    t.add_column("w = 2^(lse − max)", justify="right")
    t.add_column("w / Σw", justify="right")
    for i, (lj, wi) in enumerate(zip(lse2.tolist(), w.tolist(), strict=True)):
        t.add_row(str(i), f"{lj:g}", f"2^({lj:g} − {m:g}) = {wi:.4f}", f"{wi / tot.item():.4f}")
    console.print(t)
    lse_nat = (torch.log2(tot) + m).item() / LOG2E
    console.print(
        f"max = {m:g};  Σw = {tot.item():.4f};  O = Σ w_i·o_accum\\[i] / Σw;  "
        f"lse = (log2 Σw + max) / log2(e) = {lse_nat:.4f} (natural log)"
    )
    console.print(
        "[dim]note: the walkthrough prints 0.1353 and 1.8932 for the third weight and the sum, an arithmetic slip: "
        "0.1353 = e^-2, while 2^(2.1 − 4.2) = 0.2333.[/dim]"
    )


# --------------------------------------------------------------------------------------------
# commands


def _pick_device(choice: str) -> torch.device:
    import torch

    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        # exit status 2: kernels unavailable (the README's contract for the demo)
        print("sparse-mla: error: --device cuda, but torch.cuda.is_available() is False", file=sys.stderr)
        raise SystemExit(2)
    return torch.device(choice)


def cmd_demo(args: argparse.Namespace) -> int:
    """Walk the walkthrough's worked example; 0 = PASS, 1 = FAIL, 2 = could not run."""
    device = _pick_device(args.device)
    if device.type == "cpu" and not args.reference:
        # before anything imports triton or a kernel module: run the kernels in the interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from .. import __version__

    console = _make_console()
    console.print(
        f"[bold]sparse_mla {__version__}[/bold] demo: the worked example of FlashMLA's sparse decode "
        f"walkthrough, end to end  (torch {torch.__version__}, triton {triton_version()})"
    )
    console.print(
        f"[dim]Step numbers are the walkthrough's; {DESIGN_DOC} in the repository lists them, where each lives "
        "in the code, and the contract and tolerances the checks use.[/dim]"
    )
    _section_config(console)
    _section_token(console, args.seed)
    table = _section_schedule(console)
    rc = _section_decode(console, args, device, table)
    _section_combine(console)
    return rc


def cmd_serve_sim(args: argparse.Namespace) -> int:
    """Decode-loop simulation (``sparse_mla.serve_sim``); 0 = ran and its final check passed."""
    from .serve_sim_cli import cli_main  # sets TRITON_INTERPRET on the CPU before any kernel import

    return cli_main(args)


def cmd_targets(args: argparse.Namespace) -> int:
    """The offline compile matrix and the local backends (:mod:`.targets`)."""
    from .targets import cmd_targets as run

    return run(args)


#: subcommand name -> (help, handler); bench / check / serve-sim are planned
COMMANDS: dict[str, tuple[str, Callable[[argparse.Namespace], int]]] = {
    "demo": (
        (
            "walk the worked example of FlashMLA's sparse decode end to end (config, FP8 token, scheduler, "
            "decode, combine; step numbers: docs/design.md)"
        ),
        cmd_demo,
    ),
    "serve-sim": (
        "decode-loop simulation: paged FP8 cache write, index conversion, sparse decode in a CUDA graph",
        cmd_serve_sim,
    ),
    "targets": (
        "will it run on my GPU? every kernel compiled offline for each known GPU target, and the backend "
        "each operation uses on this machine",
        cmd_targets,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__
    from .serve_sim_cli import add_arguments as _serve_sim_arguments
    from .serve_sim_cli import seed_type

    p = argparse.ArgumentParser(
        prog="sparse-mla",
        description="DeepSeek Sparse Attention MLA decode kernels in Triton with FlashMLA's API.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    demo = sub.add_parser("demo", help=COMMANDS["demo"][0], description=COMMANDS["demo"][0])
    demo.add_argument("--seed", type=seed_type, default=0, help="random seed of the demo's inputs (default 0)")
    demo.add_argument(
        "--reference",
        action="store_true",
        help="run the decode through the PyTorch reference instead of the Triton kernels",
    )
    demo.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto (default): CUDA when torch.cuda.is_available(), else the CPU (Triton interpreter)",
    )
    demo.set_defaults(func=COMMANDS["demo"][1])

    sim = sub.add_parser("serve-sim", help=COMMANDS["serve-sim"][0], description=COMMANDS["serve-sim"][0])
    _serve_sim_arguments(sim)
    sim.set_defaults(func=COMMANDS["serve-sim"][1])

    tg = sub.add_parser("targets", help=COMMANDS["targets"][0], description=COMMANDS["targets"][0])
    tg.add_argument("--json", metavar="FILE", default=None, help="also write the matrix as JSON to FILE")
    tg.add_argument(
        "--target", metavar="NAME", action="append", default=[], help="only this target (repeatable; default: all)"
    )
    tg.set_defaults(func=COMMANDS["targets"][1])
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``sparse-mla`` and ``python -m sparse_mla``; returns the exit status: 0 passed,
    1 a check failed, 2 a usage error (bad flags, a bad ``SPARSE_MLA_BACKEND``, sizes the machine
    cannot allocate: one line on stderr; ``SPARSE_MLA_TRACEBACK=1`` raises instead)."""
    args = build_parser().parse_args(argv)
    try:
        from ..core.target import emulated_target
        from ..decode.backends import check_backend_override

        check_backend_override()  # a usage error whichever path the command takes (the CUDA demo's
        # --reference calls the twin directly and would never read it)
        emulated_target()  # likewise SPARSE_MLA_TARGET
        return int(args.func(args))
    except (ValueError, TypeError, MemoryError, RuntimeError) as e:
        if os.environ.get("SPARSE_MLA_TRACEBACK") == "1" or (
            isinstance(e, RuntimeError) and not _is_allocation_failure(e)
        ):
            raise
        what = "cannot allocate the requested sizes" if not isinstance(e, (ValueError, TypeError)) else "error"
        print(
            f"sparse-mla {args.command}: {what}: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
            file=sys.stderr,
        )
        return 2


def _is_allocation_failure(e: RuntimeError) -> bool:
    """A CPU or CUDA allocation that failed (the sizes asked for more memory than there is)."""
    import torch

    msg = str(e).lower()
    return (
        isinstance(e, torch.OutOfMemoryError) or "alloc" in msg or "out of memory" in msg or "not enough memory" in msg
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
