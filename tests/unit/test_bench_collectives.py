"""bench/collectives.py's transports: ``--transport torch|native|both``, the refusal of ``native``
where NCCL cannot run (status 2, one line, nccl_available()'s reason) and the side-by-side rows."""

from __future__ import annotations

import pytest

from bench import collectives
from bench.common import Record


def test_transport_names():
    assert collectives.transport_names(["torch"]) == ["torch"]
    assert collectives.transport_names(["both"]) == ["torch", "native"]
    assert collectives.transport_names(["native", "both", "torch"]) == ["native", "torch"]


def _refusal(argv: list[str], capsys) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as e:
        collectives.main(argv)
    err = capsys.readouterr().err
    return e.value.code, [line for line in err.splitlines() if line.strip()]


@pytest.mark.parametrize("transport", ["native", "both"])
def test_native_refused_with_the_reason(transport, capsys, monkeypatch):
    """Before any rank starts: exit status 2 and one line with nccl_available()'s reason (its
    newlines folded), so a script can tell "not here" from a failed measurement."""
    import flcomm.comm.nccl as nccl

    monkeypatch.setattr(nccl, "nccl_available", lambda: (False, "no CUDA device is visible\n(stand-in reason)"))
    code, lines = _refusal(["--transport", transport, "--nproc", "2"], capsys)
    assert code == 2, code
    assert lines == ["bench/collectives.py: --transport native is unavailable here: no CUDA device is visible "
                     "(stand-in reason)"], lines


def test_native_refused_here_without_nccl(capsys):
    """The real reason on a machine where NCCL cannot run (this test's subject is that machine)."""
    from flcomm.comm.nccl import nccl_available

    ok, reason = nccl_available()
    if ok:
        pytest.skip(f"NCCL can run here ({reason}): nothing to refuse")
    code, lines = _refusal(["--transport", "native"], capsys)
    assert code == 2 and len(lines) == 1 and " ".join(reason.split()) in lines[0], (code, lines)


def _rec(transport: str, collective: str, size: int, time_us: float, busbw: float) -> Record:
    return Record(collective=collective, algo="flat", transport=transport, world=2, size_bytes=size, dtype="float",
                  time_us=time_us, algbw_gbps=size / time_us / 1e3, busbw_gbps=busbw, wire_bytes=size, max_err=0.0,
                  count=size // 4)


def test_side_by_side_rows_pair_torch_and_native():
    recs = [_rec("torch", "all_reduce", 1024, 10.0, 2.0), _rec("torch", "all_reduce", 4096, 20.0, 4.0),
            _rec("native", "all_reduce", 1024, 5.0, 3.0), _rec("torch", "all_gather", 1024, 8.0, 1.0)]
    rows = collectives.side_by_side_rows(recs)
    assert len(rows) == 1, rows  # only the row measured on both transports
    cols = rows[0].split()
    assert cols[:5] == ["all_reduce", "flat", "1024", "256", "float"], cols
    assert [float(c) for c in cols[5:]] == pytest.approx([10.0, 1024 / 10.0 / 1e3, 2.0, 5.0, 1024 / 5.0 / 1e3, 3.0,
                                                          3.0 / 2.0], abs=1e-3)
    assert collectives.side_by_side_rows([r for r in recs if r.transport == "torch"]) == []
