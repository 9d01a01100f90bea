"""The repository speaks of the product: no tracked text file names the work that produced it (numbered
work periods, this project's tracker numbers). References to other projects' trackers ("vLLM PR
#55177", "SGLang #33194") are fine."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "__pycache__", ".pytest_cache", ".ruff_cache"}

# the words are assembled from pieces so that this file does not match its own patterns
_SESSION = "sess" + "ions?"
_ISSUE = "iss" + "ues?"
_NUM = r"#?\d+(?:\s*[-–]\s*#?\d+)?"
FORBIDDEN = re.compile(
    rf"\b(?i:{_SESSION})[\s_-]*{_NUM}\b"  # the word, a number or a range
    rf"|\b(?i:work[\s-]+{_SESSION})\b"
    rf"|\b(?i:{_ISSUE})\s*#\d+"  # a tracker number
    rf"|\b(?:I{_ISSUE[1:]}|ISSUES?)\s*{_NUM}\b"  # capitalised: a noun even before a word
    # lower case: a noun unless a word follows the number (the verb: "each warp ... 16 loads")
    rf"|\b{_ISSUE}\s*{_NUM}\b(?!\s+[A-Za-z])"
)
# another project named just before the match makes it a reference to that project's tracker
EXTERNAL = re.compile(
    r"(vllm|sglang|flashmla|flash-mla|deepgemm|deepseek|triton|pytorch|torch|cutlass|cuda|nvidia|"
    r"tilelang|flashinfer|github\.com/[\w.-]+/[\w.-]+)[\w\s/'’:-]{0,12}$",
    re.IGNORECASE,
)


def _tracked_files() -> list[Path]:
    if (ROOT / ".git").exists():
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout.decode()
        return [ROOT / p for p in out.split("\0") if p]
    files = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        files.extend(Path(dirpath) / f for f in filenames)
    return files


def _text(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:  # listed by git but absent from the work tree (deleted, not yet committed)
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def find_laboratory_words(text: str) -> list[tuple[int, str]]:
    """(line number, matched words) of each reference to the work behind the code in ``text``."""
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for m in FORBIDDEN.finditer(line):
            if EXTERNAL.search(line[: m.start()]):
                continue
            found.append((lineno, m.group(0)))
    return found


def test_the_pattern():
    s, i = "sess" + "ion", "iss" + "ue"
    for bad in (
        f"{s} 17",
        f"{s}24",
        f"{s}s 5-6",
        f"work {s}",
        f"{i} 11",
        f"{i} #42",
        f"{i}s 11-15",
        f"({i} 13)",
        f"I{i[1:]} 12 asks",
    ):
        assert find_laboratory_words(bad), bad
    for fine in (
        "vLLM PR #55177",
        "SGLang #33194",
        f"FlashMLA {i} 12",
        f"see the {s} object",
        "issued 3 loads",
        f"each warp {i}s 16 loads",
    ):
        assert not find_laboratory_words(fine), fine


def test_no_laboratory_words_in_tracked_files():
    files = _tracked_files()
    assert any(p.name == "pyproject.toml" for p in files), "the file walk found no project files"
    hits = []
    for path in files:
        text = _text(path)
        if text is None:
            continue
        for lineno, words in find_laboratory_words(text):
            hits.append(f"{path.relative_to(ROOT)}:{lineno}: {words!r}")
    assert not hits, "words about the work rather than the product:\n" + "\n".join(hits)
