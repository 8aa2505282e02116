"""Config parsing: types checked, unknown and missing keys named, reference complete."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from fedtrain.config import from_dict, reference
from fedtrain.errors import ConfigError
from fedtrain.simulation import SimConfig


def test_defaults_fill_in():
    c = from_dict(SimConfig, {"task": "m:T"})
    assert c.rounds == 10 and c.partition.kind == "iid" and c.strategy.name == "fedavg"
    assert c.client["epochs"] == 1
    # mutable defaults are per instance
    c.client["epochs"] = 5
    assert from_dict(SimConfig, {"task": "m:T"}).client["epochs"] == 1


def test_int_is_accepted_where_float_is_expected():
    c = from_dict(SimConfig, {"task": "m:T", "partition": {"alpha": 1}})
    assert c.partition.alpha == 1.0 and isinstance(c.partition.alpha, float)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({}, "missing required key task"),
        ({"task": "m:T", "roundz": 3}, "unknown key roundz"),
        ({"task": "m:T", "rounds": "3"}, "rounds = '3' should be int"),
        ({"task": "m:T", "rounds": True}, "rounds = True should be int"),
        ({"task": "m:T", "partition": {"kind": "zipf"}}, "partition.kind = 'zipf' should be one"),
        ({"task": "m:T", "partition": {"alpah": 1}}, "unknown key partition.alpah"),
        ({"task": "m:T", "strategy": 3}, "strategy must be a table"),
        ({"task": 5}, "task = 5 should be str"),
    ],
)
def test_bad_config_names_the_key(raw, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(SimConfig, raw)


def test_reference_documents_every_key():
    lines = reference(SimConfig)
    text = "\n".join(lines)
    hints = typing.get_type_hints(SimConfig)  # f.type is a string under PEP 563
    for f in dataclasses.fields(SimConfig):
        if not dataclasses.is_dataclass(hints[f.name]):
            assert f"`{f.name}`" in text
    assert "`partition.alpha`" in text and "`strategy.fraction_fit`" in text
    assert all(line.rstrip(" |").split("|")[-1].strip() for line in lines), "a key has no doc"
