"""Installs the NCCL stand-in (tests/common/fake_nccl.py) in every Python process started with
this folder on PYTHONPATH: the trainer's launcher and ranks, which the system tests start as
subprocesses. Test-only; nothing in flcomm puts it on a path."""

from tests.common import fake_nccl

fake_nccl.install()
