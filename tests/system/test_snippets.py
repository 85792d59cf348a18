"""Every Python snippet of README.md and docs/*.md runs, as its reader would run it: under
torchrun on the CPU (gloo), with the world its marker asks for.

Each ```python block is preceded by a marker line::

    <!-- snippet: name=NAME world=4 -->               a complete script (world: torchrun ranks, 1 by default)
    <!-- snippet: world=4 after=NAME -->               NAME's code, then this block (before NAME's teardown)
    <!-- snippet: world=4 replaces=NAME:12-18 -->      NAME's code with its lines 12-18 replaced by this block

A block without a marker fails the test: no snippet goes untested. The reference is the snippet's
own exit status (a snippet asserts what it shows where it can).

A complete script of more than one rank ends with its teardown, ``dist.destroy_process_group()``:
one that leaves it to interpreter exit can abort there ("terminate called without an active
exception") when a gloo thread drops the last reference to a tensor after Python has begun to
finalize. A block ``after`` it goes before that line, where a reader would add it."""

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


TEARDOWN = "dist.destroy_process_group()"


def _code(s: dict) -> str:
    if "after" in s:
        base = _code(BY_NAME[s["after"]]).splitlines()
        end = len(base) - 1 if base and base[-1].startswith(TEARDOWN) else len(base)
        return "\n".join(base[:end] + s["code"].splitlines() + base[end:])
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


def test_every_multi_rank_script_tears_down():
    scripts = [s for s in SNIPPETS if s["marked"] and int(s.get("world", 1)) > 1]
    assert scripts
    untorn = [f"{s['page']}:{s['line']}" for s in scripts if not _code(s).splitlines()[-1].startswith(TEARDOWN)]
    assert not untorn, f"multi-rank snippets that leave {TEARDOWN} to interpreter exit: {untorn}"


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if s["marked"]], ids=lambda s: f"{s['page']}:{s['line']}")
def test_snippet_runs(snippet, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(_code(snippet) + "\n")
    world = int(snippet.get("world", 1))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"{snippet['page']}:{snippet['line']} failed (rc {r.returncode}):\n{r.stderr[-4000:]}"
