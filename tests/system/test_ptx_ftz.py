"""The nvcc flags setup.py builds with keep subnormals: each .cu file that does float arithmetic
(csrc/quant_cuda.cu, csrc/sparse_cuda.cu) compiled to PTX with setup.py's own command line has no
flush-to-zero instruction (runs nvcc; skipped without a CUDA toolkit or with a CPU build of
torch)."""

from __future__ import annotations

import pytest
import torch


def _setup_module():
    """setup.py as a module (its setup() call only runs as __main__)."""
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "setup.py")
    spec = importlib.util.spec_from_file_location("flcomm_setup", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


#: the .cu files that do float arithmetic, each with a kernel whose name must be in its PTX
FLOAT_SOURCES = [("quant_cuda.cu", "quant_blocks_kernel"), ("sparse_cuda.cu", "topk_encode_kernel"),
                 ("apply_cuda.cu", "apply_average_kernel")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("source", "kernel"), FLOAT_SOURCES, ids=[s for s, _ in FLOAT_SOURCES])
def test_no_ftz_in_float_kernels_ptx(tmp_path, source, kernel):
    """Item 2: the nvcc flags setup.py builds with must not flush subnormals to zero. Compiles
    `source` to PTX with setup.py's own command line (ptx_command: its nvcc_flags, torch's flags
    and include paths) and asserts that no `.ftz` instruction appears."""
    import os
    import subprocess

    setup = _setup_module()
    assert "--use_fast_math" not in setup.nvcc_flags() and "-ftz=false" in setup.nvcc_flags()
    home = setup.find_cuda_home()
    if home is None or not os.path.exists(os.path.join(home, "bin", "nvcc")):
        pytest.skip("no CUDA toolkit (nvcc) found: set CUDA_HOME")
    if torch.version.cuda is None:
        pytest.skip(f"torch {torch.__version__} is a CPU build: no CUDA headers to compile against")
    src = os.path.join(os.path.dirname(setup.__file__), "csrc", source)
    out = tmp_path / source.replace(".cu", ".ptx")
    cmd = setup.ptx_command(src, str(out), arch="90", cuda_home=home)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=580)
    assert p.returncode == 0, f"nvcc failed: {' '.join(cmd)}\n{p.stderr[-3000:]}"
    ptx = out.read_text()
    assert kernel in ptx, f"{kernel} is not in the PTX of {source}"
    ftz = sorted({line.split()[0] for line in ptx.splitlines() if ".ftz" in line})
    assert not ftz, f"flush-to-zero instructions in the PTX of {source}: {ftz[:10]}"
