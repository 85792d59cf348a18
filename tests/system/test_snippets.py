"""Every Python snippet of README.md and docs/*.md runs, as its reader would run it: under
torchrun on the CPU (gloo), with the world its marker asks for.

Each ```python block is preceded by a marker line::

    <!-- snippet: name=NAME world=4 -->               a complete script (world: torchrun ranks, 1 by default)
    <!-- snippet: world=4 after=NAME -->               NAME's code, then this block
    <!-- snippet: world=4 replaces=NAME:12-18 -->      NAME's code with its lines 12-18 replaced by this block

A block without a marker fails the test: no snippet goes untested. The reference is the snippet's
own exit status (a snippet asserts what it shows where it can)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*snippet:(.*?)-->")


def _snippets() -> list[dict]:
    out = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() != "```python":
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            m = MARKER.search(prev)
            attrs = dict(kv.split("=", 1) for kv in m.group(1).split()) if m else {}
            out.append({"page": page.relative_to(ROOT).as_posix(), "line": i + 1, "marked": m is not None,
                        "code": "\n".join(lines[i + 1:end]), **attrs})
    return out


SNIPPETS = _snippets()
BY_NAME = {s["name"]: s for s in SNIPPETS if "name" in s}


def _code(s: dict) -> str:
    if "after" in s:
        return _code(BY_NAME[s["after"]]) + "\n" + s["code"]
    if "replaces" in s:
        name, _, span = s["replaces"].partition(":")
        a, b = (int(x) for x in span.split("-"))
        base = _code(BY_NAME[name]).splitlines()
        return "\n".join(base[:a - 1] + s["code"].splitlines() + base[b:])
    return s["code"]


def test_every_python_block_is_marked():
    unmarked = [f"{s['page']}:{s['line']}" for s in SNIPPETS if not s["marked"]]
    assert not unmarked, f"python blocks without a snippet marker: {unmarked}"
    for s in SNIPPETS:
        for key in ("after", "replaces"):
            if key in s:
                assert s[key].partition(":")[0] in BY_NAME, (s["page"], s["line"], s[key])


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if s["marked"]], ids=lambda s: f"{s['page']}:{s['line']}")
def test_snippet_runs(snippet, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(_code(snippet) + "\n")
    world = int(snippet.get("world", 1))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"{snippet['page']}:{snippet['line']} failed (rc {r.returncode}):\n{r.stderr[-4000:]}"
