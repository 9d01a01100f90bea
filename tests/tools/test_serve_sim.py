"""Decode-loop simulation (``sparse_mla.tools.serve_sim`` / ``sparse-mla serve-sim``) at tiny CPU sizes.

Step by step: each step's decode output equals the fp32 reference on the same cache state, each
appended token's bytes equal ``quantize_k_cache`` of its values, the top-k indices are distinct
positions of the request's own blocks, blocks are allocated as contexts grow, and after N steps
every byte of the cache outside the appended slots is what the prefill left there. The command
line: usage errors exit 2 with one line and no traceback, before anything runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from cache_bytes import quantized_token_bytes, storage_bytes, token_byte_offsets
from helpers import check_decode_close

from sparse_mla.reference import sparse_decode_reference
from sparse_mla.tools.serve_sim import ServeSim, ServeSimConfig, default_config

# for tests that run the kernels in this process (the CLI tests start their own and need no mark)
needs_kernels = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1",
    reason="kernels need a GPU or TRITON_INTERPRET=1 (set before starting pytest)",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@needs_kernels
@pytest.mark.parametrize("layout,cache_dtype", [("V32", "fp8"), ("MODEL1", "uint8")])
def test_steps_match_references(layout, cache_dtype):
    # short contexts (some below topk, padded with -1) crossing page blocks of 4 during the steps
    cfg = ServeSimConfig(
        batch=3,
        topk=64,
        max_context=60,
        min_context=5,
        steps=5,
        page_block_size=4,
        h_q=16,
        layout=layout,
        cache_dtype=cache_dtype,
        seed=3,
    )
    sim = ServeSim(cfg, DEV)
    sim.prefill()
    after_prefill = storage_bytes(sim.k_cache).cpu().clone()
    ctx0 = list(sim.ctx_host)
    blocks0 = int((sim.table_host >= 0).sum())
    assert len(set(ctx0)) > 1 and min(ctx0) < cfg.topk  # different lengths, some shorter than topk
    appended_kv, appended_slots = [], []
    for step in range(cfg.steps + 1):
        out, lse = sim.step()
        if step == 0 and DEV == "cuda":
            sim.capture()  # later steps replay the CUDA graph
        assert sim.ctx_host == [c + step + 1 for c in ctx0]
        assert torch.equal(sim.ctx.cpu(), torch.tensor(sim.ctx_host, dtype=torch.int32))
        # the new token of request i went to position ctx-1 of its own block table
        slots = sim.slot_buf.view(-1).cpu().long()
        table = sim.block_table.cpu()
        for i, c in enumerate(sim.ctx_host):
            t = c - 1
            assert slots[i] == table[i, t // cfg.page_block_size] * cfg.page_block_size + t % cfg.page_block_size
        appended_kv.append(sim.kv_buf.clone())
        appended_slots.append(slots)
        stored = storage_bytes(sim.k_cache).cpu()[token_byte_offsets(sim.k_cache, slots)]
        assert torch.equal(stored, quantized_token_bytes(sim.kv_buf))
        # indices: min(topk, ctx) distinct valid positions of the request, then -1
        pos = sim.pos_buf.view(cfg.batch, cfg.topk).cpu()
        for i, c in enumerate(sim.ctx_host):
            k = min(cfg.topk, c)
            assert torch.all(pos[i, k:] == -1)
            assert sorted(pos[i, :k].tolist()) == sorted(set(pos[i, :k].tolist()))
            assert 0 <= int(pos[i, :k].min()) and int(pos[i, :k].max()) < c
            if c <= cfg.topk:
                assert sorted(pos[i, :k].tolist()) == list(range(c))  # the whole context
        assert sim._indices_ok()
        # the decode on this cache state equals the fp32 reference
        ro, rl = sparse_decode_reference(sim.q_buf, sim.k_cache, sim.idx_buf, None, 512)
        check_decode_close(out, lse, ro, rl)
    # blocks were allocated as the contexts grew, never shared between requests
    t = sim.table_host
    assert int((t >= 0).sum()) > blocks0
    for i, c in enumerate(sim.ctx_host):
        assert int((t[i] >= 0).sum()) == -(-c // cfg.page_block_size)
    used = t[t >= 0].tolist()
    assert len(used) == len(set(used))
    # after N steps: appended tokens hold quantize_k_cache of their values, everything else is unchanged
    all_slots = torch.cat(appended_slots)
    assert all_slots.unique().numel() == all_slots.numel()
    at = token_byte_offsets(sim.k_cache, all_slots)
    final = storage_bytes(sim.k_cache).cpu()
    assert torch.equal(final[at], quantized_token_bytes(torch.cat(appended_kv)))
    untouched = torch.ones_like(final, dtype=torch.bool)
    untouched[at.reshape(-1)] = False
    assert torch.equal(final[untouched], after_prefill[untouched])


@needs_kernels
def test_run_reports_latency_and_passes_its_check():
    cfg = default_config("cpu", steps=3, batch=2, max_context=200, seed=1)
    res = ServeSim(cfg, DEV).run(progress=False)
    assert res["check"]["ok"], res["check"]
    assert len(res["latencies_ms"]) == 3 and all(x > 0 for x in res["latencies_ms"])
    assert res["p50_ms"] <= res["p90_ms"] <= res["p99_ms"] <= max(res["latencies_ms"]) + 1e-9
    assert res["tokens_per_s"] == pytest.approx(2 / (res["mean_ms"] * 1e-3))
    assert res["final_context_max"] == 200 and res["graph"] is (DEV == "cuda")


@needs_kernels
@pytest.mark.parametrize("layout", ["V32", "MODEL1"])
def test_indexer_step_in_one_graph_passes_its_check(layout):
    # the whole DSA decode step: indexer key write, FP8 paged logits, top-k as slots, sparse decode
    # (one CUDA graph per step on a GPU), checked against the twins at the last step
    cfg = default_config("cpu", steps=3, batch=3, max_context=200, seed=2, layout=layout, indexer=True)
    sim = ServeSim(cfg, DEV)
    res = sim.run(progress=False)
    c = res["check"]
    assert c["ok"] and c["indexer_logits_ok"] and c["indexer_topk_ok"], c
    assert res["graph"] is (DEV == "cuda")
    # the top-k really comes from the indexer: each row's slots (a set, in no set order) hold the
    # best-scoring key's
    best = sim.logits.float().argmax(dim=1)  # row i's best position (a context token)
    table = sim.block_table.long()
    slot = table[torch.arange(3, device=table.device), best // cfg.page_block_size] * cfg.page_block_size
    slot += best % cfg.page_block_size
    assert (sim.idx_buf.view(3, -1).long() == slot.view(3, 1)).any(dim=1).all()


def _serve_sim(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="150", NO_COLOR="1")
    env.pop("TRITON_INTERPRET", None)  # the CLI sets it itself on the CPU
    return subprocess.run(
        [sys.executable, "-m", "sparse_mla", "serve-sim", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def test_cli_serve_sim(tmp_path):
    out = tmp_path / "res.json"
    r = _serve_sim(
        "--device",
        "cpu",
        "--steps",
        "2",
        "--batch",
        "2",
        "--max-context",
        "128",
        "--topk",
        "64",
        "--layout",
        "MODEL1",
        "--json",
        str(out),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for fact in ("tokens/s", "p50", "p90", "p99", "PASS", "Triton interpreter"):
        assert fact in r.stdout, fact
    res = json.loads(out.read_text())
    assert res["steps"] == 2 and res["layout"] == "MODEL1" and res["check"]["ok"]
    # the progress goes to stderr (lines: stderr is a pipe here), each with the elapsed time; the
    # report on stdout starts with its header line, as before (before: the steps' bar was printed
    # on stdout once the steps had ended, and nothing at all during the prefill and warm-up)
    assert r.stdout.startswith("serve-sim: B=2 requests, topk=64,"), r.stdout
    assert "elapsed" not in r.stdout and "step 2/2" not in r.stdout
    lines = r.stderr.splitlines()
    assert lines[0].startswith("serve-sim: 2 requests x topk 64 = 128 keys read per decode step"), r.stderr
    for start in (
        "serve-sim: prefill done in ",
        "serve-sim: warm-up step done in ",
        "serve-sim: step 2/2: ",
        "serve-sim: check against the references done in ",
    ):
        line = next((x for x in lines if x.startswith(start)), None)
        assert line is not None and line.endswith("elapsed]"), (start, r.stderr)
    assert "2 timed steps at this pace: about" in r.stderr


def test_cli_serve_sim_quiet_writes_nothing_on_stderr():
    for flag in ("--quiet", "-q", "--no-progress"):
        r = _serve_sim("--device", "cpu", "--steps", "1", "--batch", "1", "--max-context", "64", "--topk", "8", flag)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stderr == "" and "PASS" in r.stdout, (flag, r.stderr)


def test_cli_serve_sim_no_check_reports_and_exits_0():
    r = _serve_sim(
        "--device", "cpu", "--steps", "1", "--batch", "1", "--max-context", "64", "--topk", "8", "--no-check"
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tokens/s" in r.stdout and "vs fp32 reference" not in r.stdout


def test_line_progress_thins_fast_steps_and_times_each_line():
    import io

    from sparse_mla.tools.progress import LineProgress, make_progress

    buf = io.StringIO()
    assert isinstance(make_progress(buf), LineProgress)  # not a terminal: lines
    rep = LineProgress(buf)
    rep.note("sizes")
    rep.begin("prefill")
    rep.end("prefill", ": 5 tokens")
    rep.steps(200)
    for i in range(200):
        rep.step(i + 1, 200, 1e-4)
    lines = buf.getvalue().splitlines()
    assert lines[:3] == ["serve-sim: sizes", "serve-sim: prefill ...", lines[2]]
    assert lines[2].startswith("serve-sim: prefill done in ") and ": 5 tokens  [" in lines[2]
    steps = [x for x in lines if x.startswith("serve-sim: step ")]
    assert steps[0].startswith("serve-sim: step 1/200: 0.100 ms  [") and "left]" in steps[0]
    assert steps[-1].startswith("serve-sim: step 200/200: ") and steps[-1].endswith("elapsed]")
    assert len(steps) < 10  # fast steps: about a line a second, not 200
    rep.STEP_LINE_INTERVAL = 0.0  # slow steps (longer than the interval): a line each
    rep.steps(3)
    for i in range(3):
        rep.step(i + 1, 3, 2.0)
    assert sum(x.startswith("serve-sim: step ") and "/3:" in x for x in buf.getvalue().splitlines()) == 3


def test_size_notes_say_what_a_step_reads_and_warn_of_padding():
    notes = ServeSim(ServeSimConfig(batch=2, topk=300, max_context=256, steps=2), "cpu").size_notes()
    assert notes[0].startswith("2 requests x topk 300 = 600 keys read per decode step (h_q 16); memory: at least ")
    assert notes[1].startswith("topk 300 > max_context 256: at most 256 of each request's 300 indices are valid")
    assert len(ServeSim(ServeSimConfig(topk=64, max_context=256), "cpu").size_notes()) == 1


@needs_kernels
def test_run_reports_every_phase_and_step():
    from sparse_mla.tools.progress import RunProgress

    class Recorder(RunProgress):
        def __init__(self):
            self.events = []

        def note(self, text):
            self.events.append("note")

        def begin(self, what):
            self.events.append(f"begin {what.split(' (')[0]}")

        def end(self, what, detail=""):
            self.events.append(f"end {what.split(' (')[0]}")

        def step(self, done, total, seconds):
            assert seconds > 0
            self.events.append(f"step {done}/{total}")

        def close(self):
            self.events.append("close")

    rec = Recorder()
    ServeSim(default_config("cpu", steps=2, batch=2, max_context=128, seed=1), DEV).run(progress=rec)
    assert rec.events == [
        "note",
        "begin prefill",
        "end prefill",
        "begin warm-up step",
        "end warm-up step",
        "step 1/2",
        "step 2/2",
        "begin check against the references",
        "end check against the references",
        "close",
    ]


def test_config_errors():
    with pytest.raises(ValueError, match="^batch"):
        ServeSim(ServeSimConfig(batch=0), "cpu")
    with pytest.raises(ValueError, match="^h_q"):
        ServeSim(ServeSimConfig(h_q=256), "cpu")
    with pytest.raises(ValueError, match="^max_context"):
        ServeSim(ServeSimConfig(max_context=40, min_context=38, steps=4), "cpu")
    with pytest.raises(ValueError, match="^cache_dtype"):
        ServeSim(ServeSimConfig(cache_dtype="bf16"), "cpu")
    with pytest.raises(ValueError, match="layout"):
        ServeSim(ServeSimConfig(layout="V4"), "cpu")
    with pytest.raises(RuntimeError, match="prefill"):
        ServeSim(ServeSimConfig(), "cpu").step()


def test_cli_no_numpy_warnings_for_blocks_without_valid_keys():
    """topk 256 over contexts of 8..128 tokens: whole 64-index blocks of -1, which Triton's interpreter
    evaluates through NumPy (-inf - -inf); its RuntimeWarnings must not reach the user."""
    r = _serve_sim(
        "--device",
        "cpu",
        "--steps",
        "1",
        "--batch",
        "2",
        "--max-context",
        "128",
        "--min-context",
        "8",
        "--topk",
        "256",
        "--h-q",
        "16",
        "--no-progress",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout
    assert "Warning" not in r.stderr and "Warning" not in r.stdout, r.stderr


@pytest.mark.parametrize(
    "args,option",
    [
        (["--batch", "0"], "--batch"),
        (["--topk", "-5"], "--topk"),
        (["--h-q", "300"], "--h-q"),
        (["--steps", "0"], "--steps"),
        (["--max-context", "40", "--min-context", "38"], "--max-context"),
        (["--min-context", "0"], "--min-context"),
        (["--page-block-size", "0"], "--page-block-size"),
        (["--num-sms", "0"], "--num-sms"),
        (["--num-sms", "1025"], "--num-sms"),  # (before: checked only by get_mla_metadata, after allocations)
        (["--seed", "-1"], "--seed"),
        (["--indexer", "--index-dim", "20"], "--index-dim"),
        (["--indexer", "--index-heads", "0"], "--index-heads"),
        (["--indexer", "--index-heads", "129"], "--index-heads"),
        (["--h-q", "0"], "--h-q"),
        (["--page-block-size", "-64"], "--page-block-size"),
        (["--steps", "-3"], "--steps"),
        (["--min-context", "300"], "--max-context"),  # the default max_context 256 leaves it no room
        (["--topk", str(2**31)], "--topk"),  # (before: a MemoryError about 9248 GiB, or int32 overflow)
        (["--max-context", str(2**31)], "--max-context"),
        (["--batch", "3000000", "--max-context", "1024"], "--batch"),  # 3.1e9 cache slots: past int32
        (["--page-block-size", str(2**31 - 1)], "--page-block-size"),  # 2 pages of 2^31 - 1 slots
        (["--index-dim", "64"], "--index-dim"),  # without --indexer it would be ignored
    ],
)
def test_cli_usage_errors_exit_2_in_one_line(monkeypatch, capsys, args, option):
    from sparse_mla.tools import cli

    # the CLI sets TRITON_INTERPRET on the CPU: keep this process's value afterwards
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    rc = cli.main(["serve-sim", "--device", "cpu", "--no-progress", *args])
    cap = capsys.readouterr()
    assert rc == 2, cap.out + cap.err
    assert cap.out == ""
    lines = cap.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"sparse-mla serve-sim: error: {option}:"), cap.err


@pytest.mark.parametrize("index_dim", ["48", "96", "512", "-16"])
def test_cli_index_dim_names_the_flag_and_the_accepted_values(monkeypatch, capsys, index_dim):
    # (before: 48, 80, 96, 112 passed the checks, and the run stopped after its header with
    # "kv_cache: last dim must be head_dim + 4 with head_dim in (16, 32, 64, 128, 256), got 52";
    # 256, which the indexer takes, was refused)
    from sparse_mla.tools import cli

    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    rc = cli.main(["serve-sim", "--device", "cpu", "--no-progress", "--indexer", "--index-dim", index_dim])
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == "", cap.out + cap.err
    assert cap.err == (
        f"sparse-mla serve-sim: error: --index-dim: expected one of 16, 32, 64, 128, 256 (the indexer kernels' "
        f"head dims, powers of two; each cached key is index_dim FP8 bytes + a 4-byte scale), got {index_dim}\n"
    )


def test_config_messages_name_fields_or_what_the_caller_calls_them():
    cfg = ServeSimConfig(indexer=True, index_dim=48)
    with pytest.raises(ValueError, match="^index_dim: expected one of 16, 32, 64, 128, 256 "):
        cfg.validate()
    with pytest.raises(ValueError, match="^--index-dim: expected one of"):
        cfg.validate(names={"index_dim": "--index-dim"})
    ServeSimConfig(indexer=True, index_dim=256, index_heads=128).validate()  # the indexer's largest sizes
    with pytest.raises(
        ValueError, match="^max_context: 40 leaves no room for min_context 38 .* lower min_context or steps"
    ):
        ServeSimConfig(max_context=40, min_context=38, steps=4).validate()


def test_cli_argparse_errors_exit_2():
    r = _serve_sim("--batch", "two")
    assert r.returncode == 2 and "invalid int value" in r.stderr, r.stderr
    r = _serve_sim("--batch", "0")  # ours, through the entry point: the same status, no traceback
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--batch" in r.stderr, r.stderr


@pytest.mark.parametrize("where", ["missing_dir", "under_a_file", "a_directory"])
def test_cli_unwritable_json_fails_before_the_simulation(tmp_path, where):
    (tmp_path / "f").write_text("x")
    path = {
        "missing_dir": tmp_path / "no" / "res.json",
        "under_a_file": tmp_path / "f" / "res.json",
        "a_directory": tmp_path,
    }[where]
    r = _serve_sim("--device", "cpu", "--no-progress", "--json", str(path), timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("sparse-mla serve-sim: error: --json:") and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stdout == ""  # no header, no steps: it stopped before the run


def test_json_path_problem_leaves_no_file(tmp_path):
    from sparse_mla.tools.serve_sim_cli import json_path_problem

    new = tmp_path / "new.json"
    assert json_path_problem(str(new)) is None and not new.exists()
    old = tmp_path / "old.json"
    old.write_text("keep")
    assert json_path_problem(str(old)) is None and old.read_text() == "keep"
    assert "directory" in json_path_problem(str(tmp_path))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cli_cuda_without_cuda_exits_2():
    r = _serve_sim("--device", "cuda", timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--device cuda" in r.stderr, r.stderr


def test_sizes_beyond_the_machine_are_refused_before_any_allocation(monkeypatch):
    # a machine that overcommits memory grants a huge allocation and kills the process when it is
    # touched (seen on a GPU host: the CLI's exit-2 test lost its worker); the run is checked first
    from sparse_mla.tools import serve_sim

    cfg = ServeSimConfig(batch=4, max_context=512, steps=2, topk=64, h_q=16, page_block_size=64)
    host, dev = ServeSim(cfg, "cpu").memory_estimate()
    assert dev >= 4 * (512 // 64) * 64 * 656  # at least the paged V32 cache
    monkeypatch.setattr(serve_sim, "available_host_bytes", lambda: host + dev - 1)
    with pytest.raises(MemoryError, match="host memory"):
        ServeSim(cfg, "cpu")
    monkeypatch.setattr(serve_sim, "available_host_bytes", lambda: host + dev)
    ServeSim(cfg, "cpu")  # exactly enough: accepted


def test_the_memory_check_reads_a_container_limit_and_counts_the_cpu_gather(monkeypatch, tmp_path):
    # a cgroup limit below MemAvailable is what the process may use (a container); on the CPU the
    # decode's gathered keys (B x topk fp32 rows) count: a huge topk is refused before prefill
    import builtins

    from sparse_mla.tools import serve_sim

    real_open = builtins.open
    files = {"/sys/fs/cgroup/memory.max": "1073741824\n", "/sys/fs/cgroup/memory.current": "536870912\n"}

    def fake_open(path, *a, **k):
        if str(path) in files:
            p = tmp_path / str(path).replace("/", "_")
            p.write_text(files[str(path)])
            return real_open(p, *a, **k)
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_open)
    avail = serve_sim.available_host_bytes()
    assert avail is not None and avail <= 512 * 2**20  # the container's 1 GiB limit less its 0.5 GiB use
    files["/sys/fs/cgroup/memory.max"] = "max\n"
    assert serve_sim.available_host_bytes() > 512 * 2**20 or serve_sim.available_host_bytes() is None
    monkeypatch.setattr(builtins, "open", real_open)
    small = ServeSimConfig(batch=2, max_context=4096, steps=1, topk=64, h_q=1, page_block_size=64)
    huge = ServeSimConfig(batch=2, max_context=4096, steps=1, topk=4_000_000, h_q=1, page_block_size=64)
    fits = sum(ServeSim(small, "cpu").memory_estimate())
    monkeypatch.setattr(serve_sim, "available_host_bytes", lambda: fits + 2 * 4_000_000 * 576 * 4 - 1)
    ServeSim(small, "cpu")
    with pytest.raises(MemoryError, match="host memory"):
        ServeSim(huge, "cpu")  # (before: prefill ran, then the decode asked for 42 GB)
