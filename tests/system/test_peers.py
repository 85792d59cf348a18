"""flcomm against torchft, the peer library: torchft's DiLoCo (FSDP2 inside each replica group,
SGD-Nesterov outer step) and ``FedAvg(outer="nesterov")`` train the same job, 2 groups x 2
ranks, and must hold the same shards after every sync. torchft is the reference here; it is the
``peers`` extra, which CI installs, so a missing torchft fails this file (it is not skipped).

Each library runs in its own processes through ``bench/peers.py``'s launcher (torchft's
lighthouse included); the comparison below reads the shards each rank saved after each sync.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import pytest
import torchft  # noqa: F401  (the peers extra: fail, do not skip, without it)

from bench import peers

GROUPS, PER_GROUP, E, ROUNDS = 2, 2, 2, 4
WORLD = GROUPS * PER_GROUP


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Each library's shards after every sync: {lib: [rank][round] -> flat fp32 array}."""
    a = argparse.Namespace(nodes=GROUPS, ranks_per_node=PER_GROUP, model="tiny", steps=E * ROUNDS,
                           batch_size=4, seq_len=64, lr=3e-3, seed=0, eval_batches=1, bucket_mb=25.0,
                           timeout=60.0)
    out = {}
    with peers.LocalCluster(GROUPS) as c:
        for row in ("tft", "fl"):
            d = str(tmp_path_factory.mktemp(row))
            peers.run_row(c, a, row, E, d, dump=True)
            out[row] = [np.load(os.path.join(d, f"shards{r}.npy"), allow_pickle=False) for r in range(WORLD)]
    return out


def test_every_group_holds_the_same_shards_after_each_sync(shards):
    for lib, per_rank in shards.items():
        for r in range(PER_GROUP, WORLD):
            mine, peer = per_rank[r], per_rank[r % PER_GROUP]
            assert mine.shape == peer.shape == (ROUNDS, mine.shape[1]), (lib, r, mine.shape)
            for k in range(ROUNDS):
                assert np.array_equal(mine[k], peer[k]), \
                    f"{lib}: rank {r} (group {r // PER_GROUP}) differs from rank {r % PER_GROUP} after sync {k + 1}"


def test_flcomm_matches_torchft_diloco(shards):
    for r in range(WORLD):
        fl, tf = shards["fl"][r], shards["tft"][r]
        assert fl.shape == tf.shape, (r, fl.shape, tf.shape)
        for k in range(ROUNDS):
            rel = np.abs(fl[k] - tf[k]).max() / np.abs(tf[k]).max()
            assert rel <= 1e-6, f"rank {r}, sync {k + 1}: max |flcomm - torchft| is {rel:.2e} of max |θ|"
    # NOTE: the shards move between syncs by far more than the tolerance: agreement is not trivial
    moved = np.abs(shards["tft"][0][-1] - shards["tft"][0][0]).max() / np.abs(shards["tft"][0][0]).max()
    assert moved > 1e-3, moved


# ---------------------------------------------------------------- recovery (bench/recovery.py)

RECOVERY_STEPS = 20


@pytest.fixture(scope="module")
def recovered(tmp_path_factory):
    """Each library's recovery run (rank 2, group 1's first, killed after step 6; its group
    restarted) and the same run without the fault: {lib: (fault run, clean run)}."""
    from bench import recovery

    # NOTE: min_step_s: the survivors' 14 steps after the kill take at least 14 s, so a restarted
    # group that starts slowly (torch and torchft's imports on a loaded machine) still meets them
    # at a sync; unpaced they ended about 5 s after the kill, and a restart a few seconds slower
    # than usual found nobody to heal from (reproduced by delaying the restart by 4 s). 10 steps
    # of 0.8 s were too few for torchft's restart beside a second xdist worker (CI, 2026-12-07)
    a = argparse.Namespace(model="tiny", steps=RECOVERY_STEPS, batch_size=2, seq_len=32, lr=3e-3, seed=0,
                           bucket_mb=25.0, timeout=60.0, ranks_per_node=PER_GROUP, kill_step=6, sync_every=[4],
                           min_step_s=1.0)
    out = {}
    with peers.LocalCluster(GROUPS) as c:
        for lib in recovery.LIBS:
            d = tmp_path_factory.mktemp(f"recovery_{lib}")
            out[lib] = (recovery.run_once(c, a, lib, 4, str(d / "kill"), True),
                        recovery.run_once(c, a, lib, 4, str(d / "clean"), False))
    return out


@pytest.mark.parametrize("lib", ["tft", "fl"])
def test_the_restarted_group_comes_back_equal_to_the_survivors(recovered, lib):
    """Both libraries: the killed group's restarted ranks hold the survivors' shards (digests)
    at a sync after the kill, the survivors ran every step once to the end, and the run without
    the fault kept every group equal at every sync."""
    from bench import recovery

    fault, clean = recovered[lib]
    got = recovery.analyse(fault, clean)
    assert got["rejoin_s"] is not None and got["rejoin_s"] > 0, got
    assert got["out_steps"] is not None and got["out_steps"] % 4 == 0 and got["out_steps"] >= 4, got
    assert got["clean_groups_agree"], got
    assert got["redone_steps"] == 0, got  # the kill is between syncs: no round is lost
    for r in range(PER_GROUP, WORLD):  # the restarted ranks trained to the end
        ends = [x for x in fault["records"][(r, 1)] if x["event"] == "end"]
        assert ends and ends[0]["step"] == RECOVERY_STEPS, (lib, r, fault["records"][(r, 1)][-3:])
    assert not any(x["event"] == "end" for x in fault["records"][(PER_GROUP, 0)])  # it was killed
