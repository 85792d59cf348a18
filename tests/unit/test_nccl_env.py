"""What the environment may say to NCCL and torch's NCCL backend, against what flcomm's bounds
rely on: ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` follows the groups' timeout (N8 of the GPU review),
and ``NCCL_COMM_BLOCKING=1``, which makes NCCL's init and split block without a bound, is refused
before any communicator is made (N9)."""

from __future__ import annotations

import warnings
from datetime import timedelta

import pytest

from flcomm.comm import nccl
from flcomm.comm.torch_pg import NONBLOCKING_TIMEOUT_ENV, bound_nonblocking_init


def test_nonblocking_init_bound_is_set_to_the_timeout_when_unset(monkeypatch):
    monkeypatch.delenv(NONBLOCKING_TIMEOUT_ENV, raising=False)
    bound_nonblocking_init(timedelta(seconds=29.2))
    import os

    assert os.environ[NONBLOCKING_TIMEOUT_ENV] == "30"  # NOTE: whole seconds, rounded up: never shorter


def test_a_users_longer_bound_is_kept_with_a_warning(monkeypatch):
    monkeypatch.setenv(NONBLOCKING_TIMEOUT_ENV, "1800")
    with pytest.warns(UserWarning, match="1800 bounds torch's NCCL communicator init, longer than the groups' "
                                         "timeout of 60 s"):
        bound_nonblocking_init(timedelta(seconds=60))
    monkeypatch.setenv(NONBLOCKING_TIMEOUT_ENV, "10")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bound_nonblocking_init(timedelta(seconds=60))  # NOTE: shorter than the timeout: nothing to say
    monkeypatch.setenv(NONBLOCKING_TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="must be a number of seconds, got 'soon'"):
        bound_nonblocking_init(timedelta(seconds=60))


@pytest.mark.parametrize("value,refused", [("1", True), ("2", True), ("0", False), ("", False)])
def test_nccl_comm_blocking_is_refused_before_a_communicator_is_made(monkeypatch, value, refused):
    monkeypatch.setenv("NCCL_COMM_BLOCKING", value)
    made = []
    monkeypatch.setattr(nccl, "_LIBRARY", type("Lib", (), {"NcclComm": lambda *a: made.append(a) or "comm"}))
    if refused:
        with pytest.raises(ValueError, match=f"NCCL_COMM_BLOCKING={value} makes NCCL's init and split block"):
            nccl.new_comm(b"x" * 128, 2, 0, 0, 5.0)
        assert made == []
    else:
        assert nccl.new_comm(b"x" * 128, 2, 0, 0, 5.0) == "comm" and made == [(b"x" * 128, 2, 0, 0, 5.0)]
