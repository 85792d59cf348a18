"""Checkpoints: a resumed FL+FSDP run continues exactly as the uninterrupted one (same losses,
same parameters, FedAvg state and data position included, resumed mid-round); a crash inside
a save leaves the previous checkpoint loadable; a checkpoint of another topology or model is
refused with both named."""

from __future__ import annotations

import json
import os

import pytest
import torch

from flcomm.federated.config import FedAvgConfig
from flcomm.train import checkpoint as ckpt
from flcomm.train.checkpoint import check_before_launch
from flcomm.train.config import TrainConfig
from tests.common.dist import run_distributed

BASE = dict(strategy="fl-fsdp", ranks_per_node=2, fedavg=FedAvgConfig(sync_every=2), model="tiny", steps=6,
            batch_size=2, seq_len=32, lr=3e-3, warmup=1, eval_batches=1, eval_fraction=0.05, max_tokens=300_000,
            progress=False, seed=0)


def fed(**settings) -> dict:
    """BASE with FedAvg settings replaced."""
    return {**BASE, "fedavg": FedAvgConfig.make(BASE["fedavg"], **settings)}


class InjectedCrash(RuntimeError):
    pass


def crash_on_step_8(tmp_dir: str) -> None:
    """Simulates a node dying during the save of step 8, after its files were written."""
    if tmp_dir.rstrip("/").endswith("step_00000008"):
        assert os.listdir(tmp_dir), "the fault should come after partial writes"
        raise InjectedCrash("injected crash during save")


def _scenario(rank: int, world: int, root: str) -> dict:
    from flcomm.train.loop import train

    a_dir, b_dir = os.path.join(root, "a"), os.path.join(root, "b")
    out: dict = {}
    # A: uninterrupted, saving at steps 3 (mid FedAvg round: E = 2) and 6
    a = train(TrainConfig(**BASE, checkpoint_dir=a_dir, save_every=3), return_params=True)
    out["a_losses"], out["a_params"] = a.losses, a.params
    # B: stopped after step 3, then resumed to 6
    train(TrainConfig(**BASE, checkpoint_dir=b_dir, save_every=3), stop_after=3)
    b = train(TrainConfig(**BASE, checkpoint_dir=b_dir, save_every=3, resume=True), return_params=True)
    out["b_start"], out["b_losses"], out["b_params"] = b.start_step, b.losses, b.params
    # C: continue B to step 8; the save of step 8 crashes after writing its files
    cfg8 = TrainConfig(**{**BASE, "steps": 8}, checkpoint_dir=b_dir, save_every=2, resume=True)
    try:
        train(cfg8, _save_fault=crash_on_step_8)
        out["crashed"] = False
    except InjectedCrash:
        out["crashed"] = True
    out["latest_after_crash"] = ckpt.latest_checkpoint(b_dir)
    out["listing_after_crash"] = sorted(os.listdir(b_dir))
    # D: the previous checkpoint (step 6) still loads and holds A's step-6 model
    d = train(TrainConfig(**BASE, checkpoint_dir=b_dir, resume=True), return_params=True)
    out["d_start"], out["d_params"] = d.start_step, d.params
    # E: the next complete save replaces the stale temporary directory
    train(cfg8)
    out["latest_final"] = ckpt.latest_checkpoint(b_dir)
    out["listing_final"] = sorted(os.listdir(b_dir))
    return out


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    return run_distributed(_scenario, 4, root, timeout=300), root


def test_resume_equals_uninterrupted(scenario):
    results, _ = scenario
    for r, out in enumerate(results):
        assert out["b_start"] == 3
        assert len(out["a_losses"]) == 6 and len(out["b_losses"]) == 3
        assert out["b_losses"] == out["a_losses"][3:], f"rank {r}"
        for n, p in out["a_params"].items():
            assert torch.equal(p, out["b_params"][n]), f"rank {r}: {n}"


def test_crash_during_save_leaves_last_checkpoint_loadable(scenario):
    results, root = scenario
    b_dir = os.path.join(root, "b")
    for out in results:
        assert out["crashed"]
        assert out["latest_after_crash"] == os.path.join(b_dir, "step_00000006")
        assert ".tmp-step_00000008" in out["listing_after_crash"]
        assert "step_00000008" not in out["listing_after_crash"]
        assert out["d_start"] == 6
        for n, p in out["a_params"].items():
            assert torch.equal(p, out["d_params"][n]), n
        assert out["latest_final"] == os.path.join(b_dir, "step_00000008")
        assert ".tmp-step_00000008" not in out["listing_final"]
        # keep_checkpoints = 2: the two newest complete ones
        assert [d for d in out["listing_final"] if d.startswith("step_")] == ["step_00000006", "step_00000008"]
    meta = ckpt.read_meta(os.path.join(b_dir, "step_00000008"))
    assert meta["step"] == 8 and meta["strategy"] == "fl-fsdp"
    assert meta["topology"] == {"world_size": 4, "ranks_per_node": 2, "group_size": 2, "shard_size": 2,
                                "mesh_shape": [2, 1, 2], "node_groups": None}


def test_checkpoint_from_another_topology_or_model_is_refused(scenario):
    _, root = scenario
    a_dir = os.path.join(root, "a")
    with pytest.raises(ValueError, match=r"another topology \(world_size=4, ranks_per_node=2, group_size=2, "
                                         r"shard_size=2\), but this run has \(world_size=4, ranks_per_node=2, "
                                         r"group_size=4, shard_size=4\)"):
        check_before_launch(TrainConfig(strategy="fsdp", ranks_per_node=2, checkpoint_dir=a_dir, resume=True), 4)
    with pytest.raises(ValueError, match="world_size=8"):
        check_before_launch(TrainConfig(**{**BASE, "ranks_per_node": 2}, checkpoint_dir=a_dir, resume=True), 8)
    with pytest.raises(ValueError, match="another model shape.*dim"):
        check_before_launch(TrainConfig(**{**BASE, "model": "small"}, checkpoint_dir=a_dir, resume=True), 4)
    # the same topology is accepted
    check_before_launch(TrainConfig(**BASE, checkpoint_dir=a_dir, resume=True), 4)


# ---------------------------------------------------------------- verified, safe loading
def _copy_ckpt(root: str, tmp_path) -> str:
    import shutil

    dst = str(tmp_path / "c")
    shutil.copytree(os.path.join(root, "a"), dst)
    return dst


def _rehash(path: str, name: str) -> None:
    """What an attacker who can write the folder does: fix meta.json after editing a file."""
    meta = ckpt.read_meta(path)
    meta["files"][name] = ckpt._hash_files(path, [name])[name]
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)


def test_corrupt_files_are_named_before_loading(scenario, tmp_path):
    _, root = scenario
    d = _copy_ckpt(root, tmp_path)
    path = ckpt.latest_checkpoint(d)
    cfg = TrainConfig(**BASE, checkpoint_dir=d, resume=True)
    check_before_launch(cfg, 4)  # intact: accepted
    victims = sorted(f for f in os.listdir(path) if f.endswith(".distcp") or f.endswith(".state.pt"))
    assert victims
    for name in victims[:2]:
        f = os.path.join(path, name)
        raw = bytearray(open(f, "rb").read())
        raw[len(raw) // 2] ^= 0x10  # one bit
        open(f, "wb").write(bytes(raw))
        with pytest.raises(ValueError, match=f"checkpoint file .*{name} does not match its SHA-256"):
            check_before_launch(cfg, 4)
        open(f, "wb").write(bytes(raw[: len(raw) // 3]))  # truncated
        with pytest.raises(ValueError, match=f"{name} has {len(raw) // 3} bytes, meta.json says {len(raw)}"):
            check_before_launch(cfg, 4)
        raw[len(raw) // 2] ^= 0x10
        open(f, "wb").write(bytes(raw))
    open(os.path.join(path, "meta.json"), "w").write('{"format": 2, "step": ')
    with pytest.raises(ValueError, match="meta.json is not valid JSON"):
        check_before_launch(cfg, 4)


# ---------------------------------------------------------------- pinning a checkpoint that others prune
def _ckpt_dir_of_steps(root: str, tmp_path, steps: list[int]) -> str:
    """A checkpoint folder with copies of scenario A's checkpoint (of step 6) renamed to
    ``steps``; ``latest`` names the last."""
    import shutil

    src = ckpt.latest_checkpoint(os.path.join(root, "a"))
    d = str(tmp_path / "c")
    for st in steps:
        shutil.copytree(src, os.path.join(d, ckpt.step_name(st)))
    (tmp_path / "c" / "latest").write_text(ckpt.step_name(steps[-1]) + "\n")
    return d


def test_pinned_checkpoint_outlives_its_pruning(scenario, tmp_path):
    import shutil

    _, root = scenario
    d = _ckpt_dir_of_steps(root, tmp_path, [6])
    into = str(tmp_path / "pin")
    pinned, original = ckpt.pin_latest(d, into)
    assert original == os.path.join(d, "step_00000006") and os.path.dirname(pinned) == into
    want = {n: open(os.path.join(original, n), "rb").read() for n in os.listdir(original)}
    shutil.rmtree(original)  # the saving job prunes it
    assert {n: open(os.path.join(pinned, n), "rb").read() for n in os.listdir(pinned)} == want
    assert ckpt.verify_files(pinned, ckpt.read_meta(pinned)) is None
    assert ckpt.pin_latest(str(tmp_path / "empty"), into) is None


def test_pin_takes_the_newer_checkpoint_when_its_choice_is_pruned(scenario, tmp_path, monkeypatch):
    import shutil

    _, root = scenario
    d = _ckpt_dir_of_steps(root, tmp_path, [6, 9])
    (tmp_path / "c" / "latest").write_text("step_00000006\n")  # step 9 is being saved
    real = ckpt._link_or_copy
    calls = []

    def saver_publishes_and_prunes(src: str, dst: str) -> None:
        if not calls:  # NOTE: after pin_latest chose step 6: step 9 published, step 6 pruned
            (tmp_path / "c" / "latest").write_text("step_00000009\n")
            shutil.rmtree(os.path.join(d, "step_00000006"))
        calls.append(src)
        real(src, dst)

    monkeypatch.setattr(ckpt, "_link_or_copy", saver_publishes_and_prunes)
    pinned, original = ckpt.pin_latest(d, str(tmp_path / "pin"))
    assert original == os.path.join(d, "step_00000009") and os.path.basename(pinned) == "step_00000009"
    assert ckpt.verify_files(pinned, ckpt.read_meta(pinned)) is None
    assert os.listdir(tmp_path / "pin") == ["step_00000009"]  # the partial pin of step 6 is gone


def test_pin_of_a_damaged_newest_checkpoint_is_left_to_the_verification(scenario, tmp_path):
    _, root = scenario
    d = _ckpt_dir_of_steps(root, tmp_path, [6])
    victim = sorted(f for f in os.listdir(os.path.join(d, "step_00000006")) if f.endswith(".distcp"))[0]
    os.remove(os.path.join(d, "step_00000006", victim))
    pinned, _ = ckpt.pin_latest(d, str(tmp_path / "pin"))  # NOTE: not retried as if pruned
    with pytest.raises(ValueError, match=f"missing \\['{victim}'\\]"):
        ckpt.verify_files(pinned, ckpt.read_meta(pinned))


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/flcomm-pwned",))


def _load_rank_state(rank: int, world: int, path: str) -> str:
    from flcomm.federated.topology import Topology
    from flcomm.train.monitor import Monitor
    from flcomm.train.run import build_run

    cfg = TrainConfig(**BASE)
    run = build_run(cfg, Monitor(None, rank, world))
    try:
        ckpt.load(path, run.model, run.optimizer, run.mesh.coords.group, Topology(4, 2, 2, 2), run.meta["model"])
    except ValueError as e:
        return str(e)
    return "loaded"


def test_crafted_state_file_is_not_executed(scenario, tmp_path):
    _, root = scenario
    d = _copy_ckpt(root, tmp_path)
    path = ckpt.latest_checkpoint(d)
    if os.path.exists("/tmp/flcomm-pwned"):
        os.remove("/tmp/flcomm-pwned")
    torch.save({"step": 6, "x": _Boom()}, os.path.join(path, "rank1.state.pt"))
    _rehash(path, "rank1.state.pt")
    out = run_distributed(_load_rank_state, 4, path, timeout=240)
    assert out[0] == out[2] == out[3] == "loaded"
    assert "rank1.state.pt cannot be loaded as tensors and plain types" in out[1]
    assert not os.path.exists("/tmp/flcomm-pwned")


def test_crafted_dcp_metadata_is_not_executed(scenario, tmp_path):
    """DCP's .metadata replaced by a pickle that runs a command, with meta.json rewritten to
    match: every rank refuses it in one line naming the file, and the command never runs."""
    import pickle

    _, root = scenario
    path = ckpt.latest_checkpoint(_copy_ckpt(root, tmp_path))
    if os.path.exists("/tmp/flcomm-pwned"):
        os.remove("/tmp/flcomm-pwned")
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump({"Metadata": _Boom()}, f)
    _rehash(path, ".metadata")
    with pytest.raises(ValueError) as pre:
        ckpt.verify_files(path, ckpt.read_meta(path))  # what the driver checks before launch
    out = run_distributed(_load_rank_state, 4, path, timeout=240)
    for msg in [str(pre.value)] + out:
        assert msg == (f"checkpoint file {os.path.join(path, '.metadata')} holds posix.system, which is not part "
                       "of DCP's metadata: refused, since loading it could run code"), msg
    assert not os.path.exists("/tmp/flcomm-pwned")


def test_dcp_metadata_of_this_torch_reads_with_the_allow_list(scenario):
    """Every type in the metadata DCP writes (this torch: CI runs 2.11 and 2.14) is allowed, and
    the restricted read equals pickle's own."""
    import pickle

    _, root = scenario
    for name in ("a", "b"):
        path = ckpt.latest_checkpoint(os.path.join(root, name))
        with open(os.path.join(path, ".metadata"), "rb") as f:
            want = pickle.load(f)
        got = ckpt.read_dcp_metadata(path)
        assert got.state_dict_metadata == want.state_dict_metadata
        assert got.storage_data == want.storage_data


def test_resume_refuses_other_data_or_seed(scenario, tmp_path):
    _, root = scenario
    a_dir = os.path.join(root, "a")
    with pytest.raises(ValueError, match="trained on other data: python-stdlib \\(300000 tokens of uint8\\), "
                                         "this run reads python-stdlib \\(250000 tokens"):
        check_before_launch(TrainConfig(**{**BASE, "max_tokens": 250_000}, checkpoint_dir=a_dir, resume=True), 4)
    check_before_launch(TrainConfig(**{**BASE, "max_tokens": 250_000}, checkpoint_dir=a_dir, resume=True,
                                    allow_data_change=True), 4)
    data = tmp_path / "d.bin"
    np_ids = torch.randint(0, 256, (300_000,), dtype=torch.int32).numpy().astype("uint16")
    np_ids.tofile(data)
    with pytest.raises(ValueError, match=f"this run reads {data}"):
        check_before_launch(TrainConfig(**BASE, data=str(data), checkpoint_dir=a_dir, resume=True), 4)
    with pytest.raises(ValueError, match="written with --seed 0, this run has --seed 1"):
        check_before_launch(TrainConfig(**{**BASE, "seed": 1}, checkpoint_dir=a_dir, resume=True), 4)


def test_resume_with_other_fedavg_settings_is_refused_before_launch(scenario, tmp_path, monkeypatch):
    """A resume with --outer nesterov over a plain-average checkpoint is refused by the
    launcher before any rank starts, naming the checkpoint, the setting and both values; an
    older checkpoint (no ``fedavg`` in meta.json) is left to the ranks' check."""
    import torch.multiprocessing as mp

    from flcomm.train.launch import launch_local

    _, root = scenario
    a_dir = os.path.join(root, "a")
    path = ckpt.latest_checkpoint(a_dir)
    # meta.json records what every rank's state file saved as FedAvg's config
    rank_cfg = torch.load(os.path.join(path, "rank0.state.pt"), weights_only=True)["fed"]["config"]
    assert ckpt.read_meta(path)["fedavg"] == rank_cfg and rank_cfg["outer"] == "avg"
    assert FedAvgConfig.from_dict(rank_cfg) == BASE["fedavg"]  # the run's config, round-tripped

    def no_ranks(*_: object, **__: object) -> None:
        raise AssertionError("a rank was started")

    monkeypatch.setattr(mp, "get_context", no_ranks)
    logs = tmp_path / "logs"
    cfg = TrainConfig(**fed(outer="nesterov"), checkpoint_dir=a_dir, resume=True, log_dir=str(logs))
    with pytest.raises(ValueError, match=f"checkpoint {path} was written with --outer avg, this run has --outer "
                                         "nesterov; resume with the same FedAvg settings"):
        launch_local(cfg, 4)
    assert not logs.exists()  # NOTE: the launcher creates it right after the checks, before the ranks
    with pytest.raises(ValueError, match="written with --no-error-feedback, this run has --error-feedback"):
        check_before_launch(TrainConfig(**fed(error_feedback=True), checkpoint_dir=a_dir, resume=True), 4)
    with pytest.raises(ValueError, match="in-place mode .* this run has --codec int8 and needs one"):
        check_before_launch(TrainConfig(**fed(codec="int8"), checkpoint_dir=a_dir, resume=True), 4)
    check_before_launch(TrainConfig(**BASE, checkpoint_dir=a_dir, resume=True), 4)  # the same: accepted
    old_dir = _copy_ckpt(root, tmp_path)
    old = ckpt.latest_checkpoint(old_dir)
    meta = ckpt.read_meta(old)
    del meta["fedavg"]
    with open(os.path.join(old, "meta.json"), "w") as f:
        json.dump(meta, f)
    check_before_launch(TrainConfig(**fed(outer="nesterov"), checkpoint_dir=old_dir, resume=True), 4)


def test_rng_state_is_the_same_run_to_run(scenario):
    _, root = scenario
    a = torch.load(os.path.join(root, "a", "step_00000006", "rank2.state.pt"), weights_only=True)
    b = torch.load(os.path.join(root, "b", "step_00000006", "rank2.state.pt"), weights_only=True)
    assert torch.equal(a["rng"]["cpu"], b["rng"]["cpu"])
