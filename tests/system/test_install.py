"""README.md's "Into your torch environment" install, run as written: a fresh virtual environment
whose torch is this test environment's (no torch download), the README's bash block in a copy of
the checkout, then ``python -m flcomm info``.

The environment reuses this interpreter's site-packages through a ``.pth`` line (``venv
--system-site-packages`` would give the base interpreter's, which has no torch when this runs
inside a venv). ``PIP_NO_INDEX=1``: the install must find everything it needs already there.
``FLCOMM_CUDA=0`` keeps the build to the C++ sources (about 30 s on 2 cores; the CUDA build is
what tools/setup.sh and CI's job setup compile)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import sysconfig

import pytest
import torch

from tests.common.native_ops import declared_operators

ROOT = pathlib.Path(__file__).resolve().parents[2]

CPU_KERNELS = declared_operators()


def readme_install_block() -> str:
    """The first bash block after README.md's "Into your torch environment"."""
    text = (ROOT / "README.md").read_text()
    start = text.index("**Into your torch environment**")
    m = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    assert m, "README.md: no bash block after 'Into your torch environment'"
    return m.group(1)


def _torch_env(venv: pathlib.Path) -> pathlib.Path:
    """A venv without pip whose sys.path ends with this environment's site-packages, and a
    ``pip`` that is ``python -m pip`` (this environment's pip, installing into the venv)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    here = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    pathlib.Path(site, "_torch_env.pth").write_text("\n".join(sorted(here)) + "\n")
    pip = venv / "bin" / "pip"
    pip.write_text(f'#!/bin/sh\nexec "{py}" -m pip "$@"\n')
    pip.chmod(0o755)
    return py


def _checkout_copy(dst: pathlib.Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            (dst / rel).write_bytes(src.read_bytes())


@pytest.mark.timeout(600)
def test_readme_install_into_an_existing_torch_environment(tmp_path):
    if not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout (git ls-files) to copy")
    venv, src = tmp_path / "env", tmp_path / "checkout"
    py = _torch_env(venv)
    _checkout_copy(src)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", PIP_NO_INDEX="1", FLCOMM_CUDA="0",
               MAX_JOBS="2", PIP_DISABLE_PIP_VERSION_CHECK="1")
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", readme_install_block()], cwd=src, env=env,
                       capture_output=True, text=True, timeout=580)
    assert r.returncode == 0, f"README install: rc {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    info = dict(line.split(None, 1) for line in r.stdout.splitlines() if re.match(r"^\w+\s+\S", line))
    assert info.get("native") == "True", r.stdout
    assert info["torch"] == torch.__version__, (info["torch"], torch.__version__)
    assert set(info["cpu_kernels"].split(", ")) == CPU_KERNELS, info["cpu_kernels"]
    # outside the checkout too, the venv's python imports the copy and the extension built into it
    where = subprocess.run([str(py), "-c", "import flcomm, flcomm._native as n; print(flcomm.__file__, "
                            "n.native().__file__)"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=120)
    assert where.returncode == 0, where.stderr
    assert all(p.startswith(str(src / "flcomm")) for p in where.stdout.split()), where.stdout
