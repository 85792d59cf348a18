"""README.md is for users: at most 200 lines, and its table of FedAvg's options is the config's
field list, with each field's default."""

from __future__ import annotations

import dataclasses
import pathlib
import re

from flcomm.federated.config import FedAvgConfig

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= 200, f"README.md has {n} lines (at most 200: measurements go to bench/results/, topics to docs/)"


def test_options_table_lists_every_field_with_its_default():
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", README.read_text(), flags=re.M)
    table = dict(rows)
    fields = dataclasses.fields(FedAvgConfig)
    assert [name for name, _ in rows if name in table] == [f.name for f in fields]
    for f in fields:
        assert table[f.name] == (f'"{f.default}"' if isinstance(f.default, str) else repr(f.default)), f.name
