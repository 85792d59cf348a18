"""The checkpoint directory's ``latest`` pointer without a run: none, one to an incomplete or
unknown-format checkpoint, and one that points outside the directory are refused."""

from __future__ import annotations

import json
import os

import pytest

from flcomm.train import checkpoint as ckpt


def test_latest_pointer_errors(tmp_path):
    assert ckpt.latest_checkpoint(str(tmp_path)) is None
    (tmp_path / "latest").write_text("step_00000001\n")
    with pytest.raises(RuntimeError, match="not a complete checkpoint"):
        ckpt.latest_checkpoint(str(tmp_path))
    os.makedirs(tmp_path / "step_00000001")
    (tmp_path / "step_00000001" / "meta.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(ValueError, match="format 99"):
        ckpt.check_compatible(ckpt.read_meta(str(tmp_path / "step_00000001")), None, {}, "x")

def test_latest_cannot_point_outside(tmp_path):
    for bad in ("../elsewhere", "/etc", "step_00000001/../../x", "x" * 300):
        (tmp_path / "latest").write_text(bad + "\n")
        with pytest.raises(ValueError, match="must name a checkpoint of this directory"):
            ckpt.latest_checkpoint(str(tmp_path))
