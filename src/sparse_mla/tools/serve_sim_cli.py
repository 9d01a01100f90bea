"""The command line of ``sparse-mla serve-sim``: its arguments, their checks, and the run that
prints (or writes as JSON) what :class:`~sparse_mla.tools.serve_sim.ServeSim` measured. The
Triton kernels are imported after the device is chosen, so on a CPU ``TRITON_INTERPRET=1`` is set
first."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from .serve_sim import CPU_DEFAULTS, GPU_DEFAULTS, MAX_SEED, ServeSim, ServeSimConfig, default_config

__all__ = ["add_arguments", "cli_main", "json_path_problem", "seed_type", "FLAGS", "KERNEL_MODULES"]


def seed_type(text: str) -> int:
    """argparse type of ``--seed``: an int in [0, 2**63 - 2] (else a usage error, exit 2)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
    if not 0 <= v <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected an int in [0, {MAX_SEED}], got {v}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``serve-sim`` options (defaults resolved per device: tiny on CPU, DeepSeek-V3.2 on CUDA)."""
    cpu, gpu = CPU_DEFAULTS, GPU_DEFAULTS
    p.add_argument(
        "--batch", "-b", type=int, default=None, help=f"requests B (default CPU {cpu['batch']}, CUDA {gpu['batch']})"
    )
    p.add_argument(
        "--topk", type=int, default=None, help=f"indices per query (default CPU {cpu['topk']}, CUDA {gpu['topk']})"
    )
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help=f"longest context reached (default CPU {cpu['max_context']}, CUDA {gpu['max_context']})",
    )
    p.add_argument("--min-context", type=int, default=None, help="shortest initial context (default max_context // 8)")
    p.add_argument(
        "--steps", type=int, default=None, help=f"timed decode steps (default CPU {cpu['steps']}, CUDA {gpu['steps']})"
    )
    p.add_argument("--page-block-size", type=int, default=None, help="tokens per page block (default 64)")
    p.add_argument("--h-q", type=int, default=None, help=f"query heads (default CPU {cpu['h_q']}, CUDA {gpu['h_q']})")
    p.add_argument("--layout", choices=("V32", "MODEL1"), default="V32", help="cache layout (default V32, d_qk 576)")
    p.add_argument("--cache-dtype", choices=("fp8", "uint8"), default="fp8", help="cache tensor dtype (default fp8)")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto (default): CUDA when available, else the CPU (Triton interpreter)",
    )
    p.add_argument("--no-graph", action="store_true", help="run the steps eagerly instead of replaying a CUDA graph")
    p.add_argument("--no-check", action="store_true", help="skip the final check against the references")
    p.add_argument(
        "--quiet",
        "-q",
        "--no-progress",
        dest="quiet",
        action="store_true",
        help="no progress on stderr (by default: the sizes, then each phase and step with the elapsed time; "
        "a bar on a terminal)",
    )
    p.add_argument("--num-sms", type=int, default=None, help="schedule for this many SMs (default: the device's)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0; range checked with the other sizes)")
    p.add_argument(
        "--indexer",
        action="store_true",
        help="pick the top-k with the lightning indexer (key cache write, FP8 paged logits, top-k as slots)",
    )
    p.add_argument("--index-heads", type=int, default=None, help="indexer query heads, 1..128 (default CPU 4, CUDA 64)")
    p.add_argument(
        "--index-dim",
        type=int,
        default=None,
        help="indexer head dim: 16, 32, 64, 128 or 256 (default CPU 32, CUDA 128)",
    )
    p.add_argument(
        "--json", metavar="PATH", default=None, help="also write the results (and every step's latency) as JSON"
    )


#: the option of each :class:`ServeSimConfig` field (what the error messages call it)
FLAGS = {name: "--" + name.replace("_", "-") for name in ServeSimConfig.__dataclass_fields__}
FLAGS.update(use_graph="--no-graph", check="--no-check")

#: the modules a simulation step imports (each needs Triton; on the CPU Triton's interpreter needs NumPy)
KERNEL_MODULES = (
    "sparse_mla.decode.kernels.portable",
    "sparse_mla.kvcache.kernels.store",
    "sparse_mla.kvcache.kernels.index_convert",
    "sparse_mla.indexer.kernels",
)


def _error(msg: str) -> int:
    """Print a one-line error the way argparse does; exit status 2 (usage error / cannot run)."""
    print(f"sparse-mla serve-sim: error: {msg}", file=sys.stderr)
    return 2


def json_path_problem(path: str) -> str | None:
    """``None`` when ``--json PATH`` can be written, else why not; leaves no new file behind.

    Checked before the simulation, so that a typo does not cost a whole run.
    """
    if os.path.isdir(path):
        return f"{path!r} is a directory"
    existed = os.path.lexists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        return f"cannot write {path!r}: {e.strerror or e}"
    if not existed:
        try:
            os.unlink(path)
        except OSError:  # pragma: no cover - we just made it
            pass
    return None


def _config(args: argparse.Namespace, device: torch.device) -> ServeSimConfig:
    """The simulation's sizes: the options given, the device's defaults for the rest."""
    return default_config(
        device,
        batch=args.batch,
        topk=args.topk,
        max_context=args.max_context,
        min_context=args.min_context,
        steps=args.steps,
        page_block_size=args.page_block_size,
        h_q=args.h_q,
        layout=args.layout,
        cache_dtype=args.cache_dtype,
        use_graph=not args.no_graph,
        seed=args.seed,
        num_sms=args.num_sms,
        check=not args.no_check,
        indexer=args.indexer,
        index_heads=args.index_heads,
        index_dim=args.index_dim,
    )


def _usage_problem(args: argparse.Namespace, cfg: ServeSimConfig) -> str | None:
    """``None`` when the options make a simulation, else why not (naming the option); checked
    before anything is allocated or imported from Triton."""
    for name in ("index_heads", "index_dim"):
        if getattr(args, name) is not None and not args.indexer:
            return f"{FLAGS[name]}: applies to the lightning indexer only; add --indexer"
    try:
        cfg.validate(names=FLAGS)  # the messages name the options the user typed
    except ValueError as e:
        return str(e)
    if args.json is not None:
        why = json_path_problem(args.json)
        if why is not None:
            return f"--json: {why}"
    return None


def cli_main(args: argparse.Namespace) -> int:
    """Run ``sparse-mla serve-sim``.

    Exit status: 0 = ran and the final check passed, 1 = the check failed, 2 = a usage error (bad
    size, unwritable ``--json`` path, ``--device cuda`` without CUDA) or the kernels cannot be
    imported (the message says why); all found before the simulation starts.
    """
    from .common import kernel_import_error, quiet_interpreter

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return _error("--device cuda, but torch.cuda.is_available() is False")
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    from rich.console import Console
    from rich.table import Table

    cfg = _config(args, device)
    why = _usage_problem(args, cfg)
    if why is not None:
        return _error(why)
    why = kernel_import_error(KERNEL_MODULES)
    if why is not None:
        return _error(f"the Triton kernels are not available: {why}")
    try:
        sim = ServeSim(cfg, device)
    except ValueError as e:
        return _error(str(e))
    console = Console(highlight=False)
    if not console.is_terminal and console.width < 110:
        console = Console(highlight=False, width=110)
    path = (
        "CUDA graph replay"
        if sim.use_graph
        else (
            "eager CUDA"
            if device.type == "cuda"
            else ("Triton interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "PyTorch reference")
        )
    )
    console.print(
        f"[bold]serve-sim[/bold]: B={cfg.batch} requests, topk={cfg.topk}, h_q={cfg.h_q}, s_q=1, {cfg.layout} "
        f"{cfg.cache_dtype} cache, page_block_size={cfg.page_block_size}, contexts {cfg.resolved_min_context()}.."
        f"{cfg.max_context} (growing), {cfg.steps} steps on {device} ({path})"
    )
    with quiet_interpreter():  # NumPy's warnings for masked-out lanes in the interpreter; see common.quiet_interpreter
        res = sim.run(progress=not args.quiet)  # on stderr: stdout keeps the report
    what = "indexer cache write + logits + top-k" if cfg.indexer else "index conversion"
    t = Table(title=f"decode loop (store + {what} + sparse decode per step)")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("device", res["device_name"])
    t.add_row("prefill", f"{res['prefill_tokens']} tokens in {res['prefill_s']:.2f} s")
    t.add_row("contexts at the end", f"{res['final_context_min']} .. {res['final_context_max']}")
    t.add_row("tokens/s", f"{res['tokens_per_s']:.1f}")
    for k in ("mean", "p50", "p90", "p99"):
        t.add_row(f"step latency {k}", f"{res[k + '_ms']:.4f} ms")
    ok = True
    if isinstance(res.get("check"), dict):  # (False: the run was asked not to check)
        c = res["check"]
        ok = c["ok"]
        t.add_row(
            "last step vs fp32 reference",
            f"max |Δout| {c['out_max_abs_err']:.2e}, cos dist {c['out_cos_dist']:.2e}, "
            f"max |Δlse| {c['lse_max_abs_err']:.2e}: " + ("ok" if c["decode_ok"] else "FAIL"),
        )
        t.add_row("appended tokens' bytes = quantize_k_cache", "ok" if c["store_ok"] else "FAIL")
        t.add_row("indices distinct, in own blocks", "ok" if c["indices_ok"] else "FAIL")
        if cfg.indexer:
            t.add_row(
                "indexer logits vs twin",
                f"max |Δ| {c['indexer_logits_max_abs_err']:.2e}: " + ("ok" if c["indexer_logits_ok"] else "FAIL"),
            )
            t.add_row("indexer top-k slots = twin's top-k", "ok" if c["indexer_topk_ok"] else "FAIL")
    console.print(t)
    console.print("[bold green]PASS[/bold green]" if ok else "[bold red]FAIL[/bold red]")
    if args.json is not None:
        try:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        except OSError as e:  # checked before the run; only a change since then gets here
            return _error(f"--json: cannot write {args.json!r}: {e.strerror or e}")
    return 0 if ok else 1
