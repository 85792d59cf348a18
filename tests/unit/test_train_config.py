"""TrainConfig's strategy (a Strategy member, given as one or by name, recorded by name) and its
command line, made from the fields' metadata by the same helper as FedAvg's
(flcomm.federated.config.add_field_arguments).

The references: the dataclass's own field list (every field but beta1 / beta2 has a flag, with the
field's default and help) and Python's json module for the record."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field

import pytest

from flcomm.federated.config import FedAvgConfig, add_field_arguments
from flcomm.federated.strategy import Strategy
from flcomm.train.__main__ import _config, _train_parser
from flcomm.train.config import OUTPUT, TrainConfig, resolve_topology

NO_FLAG = {"beta1", "beta2"}


# ------------------------------------------------------------------------------------ strategy
@pytest.mark.parametrize("given,want", [
    ("fsdp", Strategy.FSDP), ("FL+FSDP", Strategy.FL_FSDP), (" fl_hsdp ", Strategy.FL_HSDP),
    (Strategy.HSDP, Strategy.HSDP),
])
def test_strategy_is_stored_as_the_member(given, want):
    cfg = TrainConfig(strategy=given)
    assert cfg.strategy is want
    assert dataclasses.replace(TrainConfig(), strategy=given).strategy is want
    assert (cfg.federated, cfg.hybrid) == (want.federated, want.hybrid)


def test_a_bad_strategy_names_the_allowed_ones():
    with pytest.raises(ValueError, match="strategy must be one of fsdp, hsdp, fl-fsdp, fl-hsdp, got 'ddp'"):
        TrainConfig(strategy="ddp")
    with pytest.raises(ValueError, match="strategy must be one of .*, got 3"):
        TrainConfig(strategy=3)


def test_the_record_holds_the_strategy_by_name():
    cfg = TrainConfig(strategy="fl-hsdp", ranks_per_node=2)
    d = cfg.to_dict()
    assert type(d["strategy"]) is str and d["strategy"] == "fl-hsdp"
    assert json.loads(json.dumps(d))["strategy"] == "fl-hsdp"
    assert TrainConfig.from_dict(json.loads(json.dumps(d))) == cfg
    assert f"{cfg.strategy}" == "fl-hsdp"  # what the run's first line and file names print
    assert resolve_topology(cfg, 8).mesh_shape == (2, 2, 2)


def test_the_error_messages_name_the_strategy_by_name():
    with pytest.raises(ValueError, match=r"--elastic needs a federated strategy \(fl-fsdp, fl-hsdp\), got 'hsdp'$"):
        TrainConfig(strategy="hsdp", elastic=True)
    with pytest.raises(ValueError, match="which strategy fsdp does not have"):
        TrainConfig(replicate_codec="int8")


def test_the_timed_mode_is_refused_by_the_trainer_before_launch():
    """Its steps differ between groups, so a run of --steps would end the groups at different
    syncs: refused at the config, naming the flag and the way out."""
    with pytest.raises(ValueError, match=r"--sync-period-s 2.5: the reference trainer does not run FedAvg's timed "
                                         r"mode yet .* or use --sync-every$"):
        TrainConfig(strategy="fl-fsdp", fedavg=FedAvgConfig(sync_period_s=2.5))
    cfg = _config(_train_parser().parse_args(["--strategy", "fl-fsdp", "--sync-every", "4"]))
    assert cfg.fedavg.sync_period_s is None


def test_no_strategies_tuple_is_left():
    import flcomm.train
    import flcomm.train.config

    assert not hasattr(flcomm.train.config, "STRATEGIES") and "STRATEGIES" not in flcomm.train.__all__


# ------------------------------------------------------------------------------------ the flags
def test_every_field_has_its_flag_with_its_default_and_help():
    actions = {a.dest: a for a in _train_parser()._actions if a.dest not in ("help", "nproc")}
    fed = {f.name for f in dataclasses.fields(FedAvgConfig)}
    for f in dataclasses.fields(TrainConfig):
        if f.name in NO_FLAG or f.name == "fedavg":
            assert f.name not in actions, f.name
            continue
        a = actions.pop(f.name)
        assert a.option_strings[0] == "--" + f.name.replace("_", "-"), f.name
        assert a.default == f.default and a.help == f.metadata["help"], f.name
        assert a.choices is None, f.name  # NOTE: __post_init__ checks, accepting other spellings (FL+FSDP)
    assert set(actions) == fed  # FedAvg's flags, once each
    assert _config(_train_parser().parse_args([])) == TrainConfig()


def test_flags_reach_the_config():
    argv = ["--strategy", "FL+HSDP", "--ranks-per-node", "2", "--hierarchical", "--elastic-grace-s", "2.5",
            "--no-progress", "--resume", "--checkpoint-dir", "ck", "--warmup", "3", "--transport", "native",
            "--sync-every", "4", "--overlap"]
    cfg = _config(_train_parser().parse_args(argv))
    assert (cfg.strategy, cfg.ranks_per_node, cfg.hierarchical, cfg.elastic_grace_s, cfg.progress, cfg.resume,
            cfg.checkpoint_dir, cfg.warmup, cfg.transport) == (Strategy.FL_HSDP, 2, True, 2.5, False, True, "ck", 3,
                                                               "native")
    assert (cfg.fedavg.sync_every, cfg.fedavg.overlap_steps) == (4, "auto")
    with pytest.raises(SystemExit):  # --resume stays a plain switch
        _train_parser().parse_args(["--no-resume"])


def test_compare_has_the_common_flags_only(capsys):
    from flcomm.train.__main__ import main

    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    out = capsys.readouterr().out
    assert "--nproc" in out and "--sync-every" in out and "--progress" in out
    assert "--strategy " not in out and "--resume" not in out and f"\n{OUTPUT}:" not in out


# ------------------------------------------------------------------------------------ the helper
@dataclass(frozen=True)
class _Toy:
    n: int | None = field(default=None, metadata={"help": "n", "group": "g"})
    x: float = field(default=0.5, metadata={"help": "x", "group": "g"})
    on: bool = field(default=False, metadata={"help": "on"})
    quiet: bool = field(default=False, metadata={"help": "q", "flag": {"action": "store_true"}})
    name: str = field(default="a", metadata={"help": None, "group": "h",
                                               "also": {"--b": {"action": "store_const", "const": "b"}}})
    hidden: int = 3


def test_the_helper_takes_the_kinds_from_the_type_hints():
    p = argparse.ArgumentParser()
    add_field_arguments(p, _Toy())
    a = p.parse_args(["--n", "3", "--x", "2", "--on", "--quiet", "--b"])
    assert (a.n, a.x, a.on, a.quiet, a.name) == (3, 2.0, True, True, "b") and not hasattr(a, "hidden")
    assert [g.title for g in p._action_groups][-2:] == ["g", "h"]
    help_ = {x.dest: x.help for x in p._actions}
    assert (help_["n"], help_["on"], help_["name"]) == ("n (default: %(default)s)", "on", None)


def test_the_helper_selects_groups_and_uses_groups_given():
    p = argparse.ArgumentParser()
    mine = p.add_argument_group("mine")
    add_field_arguments(p, _Toy(), groups=("g",), into={"g": mine}, show_defaults=False)
    assert [x.dest for x in mine._group_actions] == ["n", "x"]
    assert {x.dest for x in p._actions} == {"help", "n", "x"}
    assert all(x.help in ("n", "x") for x in mine._group_actions)
