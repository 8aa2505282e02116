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


# -- ${VAR} in paths ----------------------------------------------------------------------
def test_every_path_of_a_server_and_a_site_config_may_come_from_the_environment(monkeypatch):
    from fedtrain.runtime.config import ServerConfig, SiteConfig

    monkeypatch.setenv("FT_DATA", "/srv/fl")
    tls = {"ca": "${FT_DATA}/tls/ca.crt", "cert": "${FT_DATA}/tls/s.crt", "key": "${FT_DATA}/k"}
    server = from_dict(ServerConfig, {"task": "m:T", "run_dir": "${FT_DATA}/runs", "tls": tls})
    assert server.run_dir == "/srv/fl/runs"
    assert (server.tls.ca, server.tls.cert, server.tls.key) == (
        "/srv/fl/tls/ca.crt",
        "/srv/fl/tls/s.crt",
        "/srv/fl/k",
    )
    site = from_dict(
        SiteConfig,
        {
            "task": "m:T",
            "task_options": {"folder": "${FT_DATA}/images", "sizes": ["${FT_DATA}", 3]},
            "tls": tls,
            "data": {"source": "csv", "path": "${FT_DATA}/t.csv", "label": "y"},
        },
    )
    assert site.tls.key == "/srv/fl/k" and site.data.path == "/srv/fl/t.csv"
    assert site.task_options == {"folder": "/srv/fl/images", "sizes": ["/srv/fl", 3]}
    sim = from_dict(SimConfig, {"task": "m:T", "run_dir": "${FT_DATA}/sim"})
    assert sim.run_dir == "/srv/fl/sim"


def test_a_default_stands_in_for_an_unset_or_empty_variable(monkeypatch):
    monkeypatch.delenv("FT_UNSET", raising=False)
    monkeypatch.setenv("FT_EMPTY", "")
    c = from_dict(SimConfig, {"task": "m:T", "run_dir": "${FT_UNSET:-runs/a}/${FT_EMPTY:-b}"})
    assert c.run_dir == "runs/a/b"


def test_an_unset_variable_is_an_error_naming_the_key_and_the_variable(monkeypatch):
    from fedtrain.runtime.config import ServerConfig

    monkeypatch.delenv("FT_UNSET", raising=False)
    with pytest.raises(ConfigError, match=r"tls\.cert = .* environment variable FT_UNSET"):
        from_dict(ServerConfig, {"task": "m:T", "tls": {"cert": "${FT_UNSET}/s.crt"}})


def test_double_dollar_is_a_literal_dollar_and_keys_that_are_not_paths_stay_as_written(
    monkeypatch,
):
    from fedtrain.runtime.config import SiteConfig

    monkeypatch.setenv("FT_DATA", "/srv")
    c = from_dict(SiteConfig, {"task": "m:T", "name": "${FT_DATA}", "task_options": {"p": "$${X}"}})
    assert c.name == "${FT_DATA}" and c.task_options == {"p": "${X}"}


def test_the_reference_marks_the_keys_that_expand_variables():
    text = "\n".join(reference(SimConfig))
    assert "| `run_dir` | str (`${VAR}`) |" in text
    assert "| `rounds` | int |" in text
