"""FedAvgConfig, the one home of FedAvg's settings: its checks, and the command lines (trainer and
cost model), TrainConfig, the cost model's Plan and the checkpoint record carrying the same object
(the checkpoint a run writes: tests/dist/test_checkpoint.py).

The references: the dataclass's own field list (every field must have a flag, a help, a check)
and Python's json module for the record."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import pathlib
import re

import pytest

from flcomm.codecs import Int8Codec
from flcomm.federated.config import AUTO, FedAvgConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]

# field -> a bad value (each must be refused, naming the field and showing the value)
BAD = {
    "sync_every": 0, "codec": "zip", "block_size": 0, "error_feedback": "yes", "outer": "adam",
    "outer_lr": 0.0, "outer_momentum": 1.0, "inner_state": "x", "overlap_steps": 9, "fragments": 3,
    "sync_period_s": 0.0, "bucket_cap_mb": 0, "offload": "gpu", "residual_dtype": "fp8", "sharded_exchange": 1,
    "verify": "yes",
}


def test_every_field_has_a_bad_value_here():
    assert set(BAD) == {f.name for f in dataclasses.fields(FedAvgConfig)}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_value_names_the_field_and_what_came(name):
    kw = {name: BAD[name]}
    if name == "block_size":
        kw["codec"] = "int8"
    with pytest.raises(ValueError) as e:
        FedAvgConfig(**kw)
    msg = str(e.value)
    assert name.split("_")[0] in msg and repr(BAD[name]) in msg, msg


@pytest.mark.parametrize("kw,match", [
    (dict(codec="none", block_size=64), "block_size applies to the blockwise codecs .int8, fp8."),
    (dict(codec=Int8Codec(block_size=64), block_size=32), "set the block size on the codec"),
    (dict(sync_every=4, fragments=2, inner_state="reset"), "not supported with fragments > 1"),
    (dict(sync_every=2, overlap_steps=3), r"in \[0, 2\] \(at most sync_every\) or 'auto', got 3"),
    (dict(overlap_steps="later"), "overlap_steps .* or 'auto', got 'later'"),
    (dict(sync_period_s=float("inf")), r"sync_period_s \(T, seconds between syncs\) must be a finite number > 0"),
    (dict(sync_period_s=2.5, overlap_steps=AUTO), "overlap_steps='auto' measures against E / K steps, which "
                                                  "sync_period_s=2.5 replaces: give overlap_steps as an integer k"),
])
def test_cross_field_rules(kw, match):
    with pytest.raises(ValueError, match=match):
        FedAvgConfig(**kw)


def test_normalized_values_and_derived_properties():
    c = FedAvgConfig(codec="INT8", outer="Nesterov", inner_state="KEEP", overlap_steps=AUTO)
    assert (c.codec, c.outer, c.inner_state, c.overlap) == ("int8", "nesterov", "keep", True)
    assert FedAvgConfig().in_place and not FedAvgConfig().overlap
    for kw in (dict(codec="int8"), dict(outer="nesterov"), dict(overlap_steps=1), dict(error_feedback=True)):
        assert not FedAvgConfig(**kw).in_place, kw
    codec = Int8Codec(block_size=64)
    c = FedAvgConfig(codec=codec)
    assert c.codec_obj is codec and (c.codec, c.block_size) == ("int8", 64)
    assert FedAvgConfig.make(c, sync_every=4).codec_obj is codec  # kept through a replace
    assert FedAvgConfig(codec="fp8", block_size=32).codec_obj.block_size == 32
    with pytest.raises(ValueError, match="elastic federation does not support overlap with fragments"):
        FedAvgConfig(sync_every=4, fragments=2, overlap_steps=1).check_elastic()
    with pytest.raises(ValueError, match="sync_period_s=3 is not supported by an elastic federation yet"):
        FedAvgConfig(sync_period_s=3).check_elastic()
    assert FedAvgConfig(sync_period_s=3).timed and not FedAvgConfig().timed
    assert FedAvgConfig(sync_period_s=3).sync_period_s == 3.0 and FedAvgConfig(sync_period_s=3).in_place
    with pytest.raises(TypeError, match=r"unknown FedAvg setting\(s\) \['overlap'\] \(overlap is overlap_steps"):
        FedAvgConfig.make(overlap=True)


def _parse(argv: list[str]) -> FedAvgConfig:
    p = argparse.ArgumentParser()
    FedAvgConfig.add_arguments(p)
    return FedAvgConfig.from_args(p.parse_args(argv))


def test_flags_are_the_fields_with_their_help_and_defaults():
    p = argparse.ArgumentParser()
    FedAvgConfig.add_arguments(p)
    # NOTE: --overlap, and the deprecated spellings (hidden), are further flags of a field
    actions = {a.dest: a for a in p._actions
               if a.dest != "help" and a.option_strings[0] != "--overlap" and a.help != argparse.SUPPRESS}
    for f in dataclasses.fields(FedAvgConfig):
        a = actions.pop(f.name)
        assert a.option_strings[0] == "--" + f.name.replace("_", "-")
        assert a.help.startswith(f.metadata["help"]) and a.default == f.default, f.name
        assert f.metadata["source"], f.name
    assert not actions
    assert _parse([]) == FedAvgConfig()


def test_cli_train_config_and_record_round_trip_one_config():
    from flcomm.train.__main__ import _config, _train_parser

    argv = ["--sync-every", "4", "--codec", "int8", "--block-size", "64", "--error-feedback", "--outer", "nesterov",
            "--outer-lr", "0.5", "--outer-momentum", "0.8", "--overlap-steps", "2", "--fragments", "2",
            "--bucket-cap-mb", "8", "--offload", "cpu", "--residual-dtype", "bf16", "--no-sharded-exchange"]
    want = FedAvgConfig(sync_every=4, codec="int8", block_size=64, error_feedback=True, outer="nesterov",
                        outer_lr=0.5, outer_momentum=0.8, overlap_steps=2, fragments=2, bucket_cap_mb=8.0,
                        offload="cpu", residual_dtype="bf16", sharded_exchange=False)
    assert _parse(argv) == want
    cfg = _config(_train_parser().parse_args(["--strategy", "fl-fsdp", *argv]))
    assert cfg.fedavg == want
    record = json.loads(json.dumps(cfg.to_dict()))["fedavg"]  # what metrics and meta.json hold
    assert FedAvgConfig.from_dict(record) == want and record["in_place"] is False
    from flcomm.costmodel import Plan
    from flcomm.costmodel.__main__ import make_parser

    assert FedAvgConfig.from_args(make_parser().parse_args(argv)) == want  # the cost model's flags
    plan = Plan("fl-fsdp", group_size=2, fedavg=want)
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert _parse(["--overlap"]).overlap_steps == AUTO
    assert _parse(["--overlap-steps", "auto"]).overlap_steps == AUTO
    with pytest.raises(ValueError, match=r"unknown FedAvg settings \['overlap'\]"):
        FedAvgConfig.from_dict({"overlap": True})


def _checks_of(path: pathlib.Path, names: set[str]) -> list[str]:
    """The checks in ``path`` of a setting in ``names``: a ``raise`` whose message says
    "<name> must ..." (or "<name> (...) must"), and a :func:`flcomm.validate.integer` /
    ``number`` call whose setting is "<name>"."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("integer", "number") and node.args:
            first = node.args[0]
            label = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else ""
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                      if re.match(rf"{n}\b", label)]
        elif isinstance(node, ast.Raise):
            text = ast.unparse(node)
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                      if re.search(rf"\b{n}\b( \([^)]*\))? must", text)]
    return found


def test_no_module_but_the_config_checks_the_fields():
    """The layers that take a FedAvgConfig (federated/, train/, costmodel/) check none of its
    fields themselves (the lower layers' own arguments, e.g. a bucketed all-reduce's bucket_mb,
    are theirs)."""
    names = {f.name for f in dataclasses.fields(FedAvgConfig)} - {"codec", "offload"}
    found = []
    for sub in ("federated", "train", "costmodel"):
        for path in sorted((ROOT / "flcomm" / sub).rglob("*.py")):
            if path.name != "config.py" or sub != "federated":
                found += _checks_of(path, names)
    assert not found, found


def test_what_must_match_on_resume_is_field_metadata():
    """The fields whose value a saved state's layout depends on (the outer update's momentum,
    the residuals, the fragments' cut) are marked on the config, and the resume check reads
    them there: each one that differs is named, an old state without ``fragments`` had 1."""
    from flcomm.federated.config import must_match_on_resume
    from flcomm.federated.persist import config_mismatch

    assert must_match_on_resume() == {"outer": None, "error_feedback": None, "fragments": 1}
    run = FedAvgConfig(sync_every=4, outer="nesterov", error_feedback=True, fragments=2, codec="int8").to_dict()
    assert config_mismatch(dict(run), run) is None
    for key, other in (("outer", "avg"), ("error_feedback", False), ("fragments", 1)):
        assert config_mismatch({**run, key: other}, run) == (key, other, run[key])
    old = {k: v for k, v in run.items() if k != "fragments"}
    assert config_mismatch(old, run) == ("fragments", None, 2)
    assert config_mismatch(old, {**run, "fragments": 1}) is None
    # NOTE: settings that change no saved layout load across runs
    assert config_mismatch({**run, "codec": "none", "sync_every": 8, "bucket_cap_mb": 1.0}, run) is None


def test_renamed_settings_warn_and_land_in_their_new_field():
    """bucket_mb is bucket_cap_mb (DDP's name): the old keyword warns, an old record loads, and
    both at once are refused."""
    import warnings as w

    with pytest.warns(DeprecationWarning, match=r"bucket_mb=\) is deprecated: use bucket_cap_mb="):
        c = FedAvgConfig.make(bucket_mb=2.0)
    assert c.bucket_cap_mb == 2.0
    with pytest.raises(TypeError, match="both bucket_cap_mb= and its deprecated name bucket_mb="):
        FedAvgConfig.make(bucket_mb=2.0, bucket_cap_mb=3.0)
    old = {k: v for k, v in FedAvgConfig(bucket_cap_mb=4.0).to_dict().items() if k != "bucket_cap_mb"}
    with w.catch_warnings():
        w.simplefilter("error")  # NOTE: a record is not the user's spelling: no warning
        assert FedAvgConfig.from_dict({**old, "bucket_mb": 4.0}) == FedAvgConfig(bucket_cap_mb=4.0)


def test_renamed_keyword_helper():
    from flcomm.federated.config import renamed

    settings = {"optimizer": "opt", "other": 1}
    with pytest.warns(DeprecationWarning, match=r"FedAvg\(optimizer=\) is deprecated: use inner_optimizer="):
        assert renamed(settings, "optimizer", "inner_optimizer", None, None) == "opt"
    assert settings == {"other": 1}
    assert renamed(settings, "optimizer", "inner_optimizer", "given", None) == "given"
    with pytest.raises(TypeError, match="both inner_optimizer= and its deprecated name optimizer="):
        renamed({"optimizer": 1}, "optimizer", "inner_optimizer", 2, None)
