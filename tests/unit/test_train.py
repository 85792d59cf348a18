"""The training driver without ranks: data slices, the LR schedule, the topology defaults, and bad
input refused before launch (the strategies on gloo are in tests/dist/test_train_strategies.py)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from flcomm.train.checkpoint import check_before_launch
from flcomm.train.config import TrainConfig, lr_at, resolve_topology
from flcomm.train.data import (
    ShardedLoader,
    builtin_corpus,
    check_vocab,
    decode,
    encode,
    eval_batches,
    fingerprint,
    load_tokens,
    split_tokens,
)
from tests.common.train_ref import schedule

torch.set_num_threads(1)

SMALL = dict(model="tiny", steps=4, batch_size=2, seq_len=32, lr=3e-3, warmup=1, eval_batches=1,
             eval_fraction=0.05, max_tokens=300_000, progress=False, seed=0)


# ------------------------------------------------------------------------------------ data
def _positions(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64)  # token value == its position in the stream


def test_slices_are_disjoint_and_deterministic():
    toks = _positions(10_000)
    D, T, B = 4, 16, 3
    seen = []
    for d in range(D):
        ld = ShardedLoader(toks, T, B, D, d, seed=7)
        got = set()
        for _ in range(3 * ld.n_windows // B + 2):  # more than two epochs
            x, y = ld.next_batch()
            assert x.shape == (B, T) and y.shape == (B, T)
            assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
            got |= set(x.flatten().tolist()) | set(y.flatten().tolist())
        lo, hi = d * (10_000 // D), (d + 1) * (10_000 // D)
        assert min(got) >= lo and max(got) < hi
        seen.append(got)
    for i in range(D):
        for j in range(i + 1, D):
            assert not seen[i] & seen[j]
    # same arguments: same stream; another seed: another order
    a, b = ShardedLoader(toks, T, B, D, 1, seed=7), ShardedLoader(toks, T, B, D, 1, seed=7)
    c = ShardedLoader(toks, T, B, D, 1, seed=8)
    xa, xb, xc = a.next_batch()[0], b.next_batch()[0], c.next_batch()[0]
    assert torch.equal(xa, xb) and not torch.equal(xa, xc)


def test_loader_resumes_from_position():
    toks = _positions(5_000)
    a = ShardedLoader(toks, 8, 4, 2, 0, seed=1)
    for _ in range(50):  # past an epoch boundary
        a.next_batch()
    sd = a.state_dict()
    b = ShardedLoader(toks, 8, 4, 2, 0, seed=1)
    b.load_state_dict(sd)
    for _ in range(5):
        assert torch.equal(a.next_batch()[0], b.next_batch()[0])
    with pytest.raises(ValueError, match="slice_index=0.*this loader has slice_index=1"):
        ShardedLoader(toks, 8, 4, 2, 1, seed=1).load_state_dict(sd)


def test_heldout_split_and_eval_batches():
    toks = _positions(20_000)
    sp = split_tokens(toks, 0.1)
    assert len(sp.train) == 18_000 and sp.heldout[0] == 18_000
    evs = [eval_batches(sp.heldout, 16, 2, 3, 4, d) for d in range(4)]
    assert all(len(e) == 3 for e in evs)
    vals = [set(torch.cat([x.flatten() for x, _ in e]).tolist()) for e in evs]
    assert all(min(v) >= 18_000 for v in vals)
    assert not vals[0] & vals[1]
    with pytest.raises(ValueError, match="too small to hold out"):
        split_tokens(toks[:10], 0.5, min_eval_tokens=10)
    with pytest.raises(ValueError, match="fewer than one window"):
        ShardedLoader(toks[:100], 64, 1, 4, 0)


@pytest.mark.parametrize("nbytes,why", [
    (12, "dataset of 12 tokens is too small to hold out"),
    (6000, "each of the 4 data slices has 498 tokens, fewer than one window of seq_len \\+ 1 = 1001"),
])
def test_a_dataset_too_small_is_refused_before_launch(tmp_path, nbytes, why):
    from flcomm.train.checkpoint import check_before_launch

    p = tmp_path / "small.txt"
    p.write_bytes(bytes(range(97, 123)) * (nbytes // 26) + b"x" * (nbytes % 26))
    with pytest.raises(ValueError, match=why):
        check_before_launch(TrainConfig(data=str(p), eval_fraction=0.01, batch_size=1, seq_len=1000), 4)


def test_builtin_corpus_and_user_files(tmp_path):
    a, b = builtin_corpus(1 << 20), builtin_corpus(1 << 20)
    assert a.dtype == np.uint8 and len(a) == 1 << 20
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(a) != fingerprint(a[:-1])
    assert "import" in decode(a[:20000])
    text = "héllo wörld\n" * 100
    assert decode(encode(text)) == text
    p = tmp_path / "c.txt"
    p.write_text(text)
    np.testing.assert_array_equal(load_tokens(str(p)), encode(text))
    ids = (np.arange(1000) * 37 % 50_000).astype(np.uint16)
    ids.tofile(tmp_path / "c.bin")
    np.save(tmp_path / "c.npy", ids.astype(np.int32))
    np.testing.assert_array_equal(load_tokens(str(tmp_path / "c.bin")), ids)
    np.testing.assert_array_equal(load_tokens(str(tmp_path / "c.npy"), max_tokens=10), ids[:10])
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_tokens(str(tmp_path / "missing.txt"))
    check_vocab(ids, 50_000, "c.bin")
    with pytest.raises(ValueError, match="c.bin has token id 36963, beyond the model's vocabulary of 256"):
        check_vocab(ids, 256, "c.bin")
    np.save(tmp_path / "f.npy", np.zeros(10, dtype=np.float32))
    with pytest.raises(ValueError, match="must be integers"):
        load_tokens(str(tmp_path / "f.npy"))
    np.save(tmp_path / "m.npy", ids[:100].reshape(10, 10))
    with pytest.raises(ValueError,
                       match=r"m.npy' holds an array of shape \(10, 10\); expected a 1-D array of token ids"):
        load_tokens(str(tmp_path / "m.npy"))


# ----------------------------------------------------------------------- config and inputs
def test_lr_schedule():
    cfg = TrainConfig(steps=100, lr=1.0, warmup=10, min_lr_ratio=0.1)
    assert lr_at(cfg, 1) == pytest.approx(0.1) and lr_at(cfg, 10) == pytest.approx(1.0)
    assert lr_at(cfg, 55) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(cfg, 100) == pytest.approx(0.1)
    assert [lr_at(cfg, t) for t in range(1, 101)] == pytest.approx([schedule(t, 1.0, 10, 100, 0.1)
                                                                    for t in range(1, 101)], rel=1e-12)


def test_topology_defaults():
    t = resolve_topology(TrainConfig(strategy="fsdp"), 8, 2)
    assert t.mesh_shape == (1, 1, 8)
    assert resolve_topology(TrainConfig(strategy="hsdp"), 8, 2).mesh_shape == (1, 4, 2)
    assert resolve_topology(TrainConfig(strategy="fl-fsdp"), 8, 2).mesh_shape == (4, 1, 2)
    assert resolve_topology(TrainConfig(strategy="fl-hsdp"), 8, 2).mesh_shape == (2, 2, 2)
    assert resolve_topology(TrainConfig(strategy="fl-hsdp"), 4, 2).mesh_shape == (2, 2, 1)
    assert resolve_topology(TrainConfig(strategy="fl-fsdp", group_size=4), 8, 2).mesh_shape == (2, 1, 4)


@pytest.mark.parametrize("kw,match", [
    (dict(strategy="ddp"), "strategy must be one of fsdp, hsdp, fl-fsdp, fl-hsdp, got 'ddp'"),
    (dict(model="gpt5"), "unknown model preset 'gpt5'"),
    (dict(resume=True), "resume needs a checkpoint directory"),
    (dict(steps=0), "steps must be an integer >= 1, got 0"),
    (dict(beta1=True), "beta1 must be a finite number in \\[0, 1\\], got True"),
    (dict(eval_fraction=1.0), "eval_fraction must be a finite number in \\(0, 1\\), got 1.0"),
])
def test_bad_config(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kw)


@pytest.mark.parametrize("kw,world,match", [
    (dict(strategy="fsdp", ranks_per_node=2), 3, "ranks_per_node 2 does not divide the world of 3"),
    (dict(strategy="fl-fsdp", ranks_per_node=2, group_size=3), 4, "group_size 3 does not divide world_size 4"),
    (dict(strategy="fl-fsdp", group_size=4), 4, "needs at least two federation groups"),
    (dict(strategy="hsdp", shard_size=4), 4, "needs at least two replicas"),
    (dict(strategy="fsdp", group_size=2), 4, "group_size is for the fl-\\* strategies"),
])
def test_topology_that_does_not_fit(kw, world, match):
    with pytest.raises(ValueError, match=match):
        resolve_topology(TrainConfig(**kw), world)


def test_cli_reports_bad_input_without_launching(capsys):
    from flcomm.train.__main__ import main

    assert main(["--strategy", "fl-fsdp", "--nproc", "3", "--ranks-per-node", "2"]) == 2
    assert "ranks_per_node 2 does not divide the world of 3" in capsys.readouterr().err
    assert main(["--strategy", "fl-fsdp", "--nproc", "4", "--sync-every", "0"]) == 2
    assert "sync_every" in capsys.readouterr().err
    assert main(["--codec", "gzip"]) == 2
    assert "unknown codec 'gzip'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="world_size 4"):
        check_before_launch(TrainConfig(strategy="fl-hsdp", ranks_per_node=2, group_size=3), 4)


@pytest.mark.parametrize("argv,match", [
    (["--timeout-s", "0"], "timeout_s must be a finite number > 0, got 0.0"),
    (["--timeout-s", "nan"], "timeout_s must be a finite number > 0, got nan"),
    (["--bucket-cap-mb", "0"], "bucket_cap_mb must be a finite number > 0, got 0.0"),
    (["--bucket-mb", "inf"], "bucket_cap_mb must be a finite number > 0, got inf"),
    (["--max-tokens", "0"], "max_tokens must be an integer >= 1, got 0"),
    (["--weight-decay", "-0.1"], "weight_decay must be a finite number >= 0, got -0.1"),
    (["--nproc", "0"], "--nproc must be an integer >= 1, got 0"),
    (["--nan-policy", "ignore"], "unknown nan_policy 'ignore'; expected one of stop, skip-step"),
    (["--vocab-size", "100", "--max-tokens", "100000"],
     r"the built-in corpus \(python-stdlib\) has token id \d+, beyond the model's vocabulary of 100"),
    (["--seq-len", "4096"], "seq_len 4096 exceeds max_seq_len 1024 of model preset 'tiny'"),
])
def test_bad_settings_are_refused_before_launch(argv, match, capsys):
    from flcomm.train.__main__ import main

    assert main(["--nproc", "2", *argv] if "--nproc" not in argv else argv) == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err
    assert err.count("\n") == 1, err  # one line, no traceback


def test_bad_data_files_are_named(tmp_path, capsys):
    from flcomm.train.__main__ import main

    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    np.save(tmp_path / "neg.npy", np.array([1, 2, -3, 4] * 100, dtype=np.int32))
    np.save(tmp_path / "big.npy", np.array([1, 2, 300, 4] * 100, dtype=np.int32))
    cases = [([str(tmp_path)], f"--data '{tmp_path}' is a directory"),
             ([str(tmp_path / "nope.txt")], "nope.txt'?: no such file"),
             ([str(tmp_path / "odd.bin")], "odd.bin' has 3 bytes, not a whole number of uint16 token ids"),
             ([str(tmp_path / "odd.bin"), "--data-dtype", "float7"], "odd.bin' cannot be read as token ids"),
             ([str(tmp_path / "neg.npy")], "neg.npy' has a negative token id \\(-3\\)"),
             ([str(tmp_path / "big.npy")], "big.npy' has token id 300, beyond the model's vocabulary of 256")]
    for extra, match in cases:
        assert main(["--nproc", "2", "--data", *extra]) == 2
        err = capsys.readouterr().err
        assert re.search(match, err), (extra, err)


def test_verify_flag_reaches_the_config():
    from flcomm.train.__main__ import _config, _train_parser

    assert _config(_train_parser().parse_args(["--verify"])).fedavg.verify is True
    assert _config(_train_parser().parse_args([])).fedavg.verify is False


# ---------------------------------------------------------------- replicate codec and transport (issue 27)

def test_replicate_and_transport_flags_round_trip():
    from flcomm.train.__main__ import _config, _train_parser

    argv = ["--strategy", "hsdp", "--replicate-codec", "int8", "--replicate-error-feedback", "--transport", "native"]
    cfg = _config(_train_parser().parse_args(argv))
    assert (cfg.replicate_codec, cfg.replicate_error_feedback, cfg.transport) == ("int8", True, "native")
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    d = _config(_train_parser().parse_args([]))
    assert (d.replicate_codec, d.replicate_error_feedback, d.transport) == ("none", False, "torch")
    new = ("replicate_codec", "replicate_error_feedback", "transport")
    old = {k: v for k, v in d.to_dict().items() if k not in new}
    assert TrainConfig.from_dict(old) == d  # NOTE: a config recorded before these fields


@pytest.mark.parametrize("argv,match", [
    (["--replicate-codec", "int8"], "expected strategy hsdp or fl-hsdp \\(R = G / S > 1 replicas\\), got fsdp"),
    (["--strategy", "fl-fsdp", "--replicate-codec", "fp8"],
     "expected strategy hsdp or fl-hsdp \\(R = G / S > 1 replicas\\), got fl-fsdp"),
    (["--strategy", "hsdp", "--replicate-codec", "int4"],
     "unknown replicate codec 'int4'; expected one of none, bf16, fp16, int8, fp8"),
    (["--strategy", "hsdp", "--replicate-codec", "topk"], "unknown replicate codec 'topk'; expected one of none, "
     "bf16, fp16, int8, fp8 \\(a dense codec"),
    (["--strategy", "hsdp", "--replicate-error-feedback"],
     "replicate error feedback keeps what the replicate codec dropped; expected a replicate codec one of "
     "bf16, fp16, int8, fp8, got none"),
    (["--strategy", "hsdp", "--shard-size", "2", "--replicate-codec", "int8"], "needs at least two replicas"),
    (["--transport", "mpi"], "unknown transport 'mpi'; expected one of torch, native"),
])
def test_replicate_codec_and_transport_are_refused_before_launch(argv, match, capsys):
    from flcomm.train.__main__ import main

    assert main(["--nproc", "2", *argv] if "--nproc" not in argv else argv) == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err
    assert err.count("\n") == 1, err  # one line, no traceback
