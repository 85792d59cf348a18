"""bench/recovery.py's columns from per-rank records built by hand, against the module
docstring's definitions worked out for these records; and the records read back from files."""

from __future__ import annotations

import json
import os

from bench import recovery

E, N, RPN = 4, 12, 2


def _steps(t0: float, dt: float, steps: list[int], digests: dict[int, str], start_iter: int = 1) -> list[dict]:
    out = [{"t": t0 - 1.0, "event": "start"}]
    for i, s in enumerate(steps):
        out.append({"t": t0 + i * dt, "event": "step", "step": s, "iter": start_iter + i, "sync": s in digests,
                    "digest": digests.get(s)})
    return out


def _clean() -> dict:
    recs = {(r, 0): _steps(100.0, 1.0, list(range(1, N + 1)), {s: f"{r % RPN}@{s}" for s in (4, 8, 12)})
            for r in range(4)}
    return {"lib": "fl", "sync_every": E, "kill_rank": 2, "steps": N, "ranks_per_node": RPN, "nodes": 2,
            "records": recs}


def test_the_columns_of_a_kill_and_a_torchft_style_redo():
    """Group 1 (ranks 2, 3) killed after step 6 at t = 105.5; the survivors' sync at step 8 is not
    committed and its round is trained again (steps 5-8 twice: 4 redone), 3 s later than in the
    clean run; the restarted group's shards equal the survivors' first at step 8, at t = 112."""
    clean = _clean()
    surv_steps = [1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # the loop's step after each iteration
    recs = {}
    for r in (0, 1):
        xs = _steps(100.0, 1.0, surv_steps[:7], {4: f"{r}@4"})
        # the failed sync returns the step to 4 (no digest match possible), then a redo
        xs += [{"t": 110.0 + i, "event": "step", "step": s, "iter": 8 + i, "sync": s % E == 0,
                "digest": (f"{r}@{s}" if s % E == 0 else None)} for i, s in enumerate(surv_steps[7:])]
        recs[(r, 0)] = xs
    for r in (2, 3):
        xs = _steps(100.0, 1.0, [1, 2, 3, 4, 5, 6], {4: f"{r % RPN}@4"})
        if r == 2:
            xs.append({"t": 105.5, "event": "kill", "step": 6})
        recs[(r, 0)] = xs
        # restarted: its own first sync (a digest nobody has), then healed at step 8 at t = 112
        recs[(r, 1)] = [{"t": 109.0, "event": "start"},
                        {"t": 110.0, "event": "step", "step": 4, "iter": 4, "sync": True, "digest": "fresh"},
                        {"t": 112.0 + 0.5 * (r - 2), "event": "step", "step": 8, "iter": 5, "sync": True,
                         "digest": f"{r % RPN}@8"}]
    fault = {**clean, "records": recs}
    got = recovery.analyse(fault, clean)
    # survivors: first step at 100, last (16th record, step 12) at 110 + 8 = 118: span 18 s, clean 11 s
    assert got["survivors_extra_s"] == 18.0 - 11.0
    assert got["redone_steps"] == len(surv_steps) - N == 4
    # the later of the two restarted ranks matched at 112.5; killed at 105.5
    assert got["rejoin_s"] == 112.5 - 105.5
    assert got["out_steps"] == 8 - 4 and got["kill_step"] == 6 and got["clean_groups_agree"]


def test_a_group_that_never_matches_has_no_rejoin_time_and_a_split_clean_run_is_flagged():
    clean = _clean()
    clean["records"][(3, 0)][-1]["digest"] = "other"  # group 1's rank 3 disagreed at step 12
    recs = {k: list(v) for k, v in clean["records"].items()}
    recs[(2, 0)] = recs[(2, 0)][:7] + [{"t": 106.5, "event": "kill", "step": 6}]
    recs[(2, 1)] = recs[(3, 1)] = [{"t": 109.0, "event": "start"}]
    got = recovery.analyse({**clean, "records": recs}, clean)
    assert got["rejoin_s"] is None and got["out_steps"] is None
    assert got["redone_steps"] == 0 and got["survivors_extra_s"] == 0.0
    assert not got["clean_groups_agree"]
    assert "groups disagreed" in recovery.table([got]) and " - " in recovery.table([got])


def test_records_and_runs_read_back(tmp_path):
    clean = _clean()
    for tag, run in (("kill", clean), ("clean", clean)):
        d = tmp_path / f"recovery_fl_E{E}_{tag}"
        os.makedirs(d)
        meta = {k: v for k, v in run.items() if k != "records"}
        (d / "run.json").write_text(json.dumps(meta))
        for (r, inc), xs in run["records"].items():
            (d / f"rank{r}.inc{inc}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in xs))
    (tmp_path / f"recovery_fl_E{E}_kill" / "rank2.inc0.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in clean["records"][(2, 0)][:7] + [{"t": 106.5, "event": "kill",
                                                                                "step": 6}]))
    back = recovery.read_run(str(tmp_path / f"recovery_fl_E{E}_clean"))
    assert back["records"] == clean["records"] and back["steps"] == N
    rows = recovery.reanalyse([str(tmp_path)])
    assert len(rows) == 1 and rows[0]["lib"] == "fl" and rows[0]["kill_step"] == 6


def test_a_run_whose_rank_was_never_killed_is_refused_by_name():
    clean = _clean()
    try:
        recovery.analyse(clean, clean)
    except ValueError as e:
        assert "rank 2 has no kill record" in str(e)
    else:
        raise AssertionError("analyse accepted a run without a kill record")
