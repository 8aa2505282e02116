"""`fedtrain report`: real PNGs and an HTML page from a real run directory."""

from __future__ import annotations

import json

import pytest

from fedtrain.config import from_dict
from fedtrain.errors import ConfigError
from fedtrain.observability.report import participation, write_report
from fedtrain.simulation import SimConfig, run_simulation

PNG = b"\x89PNG\r\n\x1a\n"


def test_report_from_a_simulation_run(tmp_path):
    config = from_dict(
        SimConfig,
        {
            "task": "fedtrain.examples:BreastCancerTask",
            "rounds": 3,
            "num_clients": 3,
            "run_dir": str(tmp_path / "run"),
            "client": {"lr": 0.1},
        },
    )
    run_simulation(config)
    # the runtime's audit log adds participation
    audit = [
        {"event": "round_completed", "round": 1, "contributors": ["a", "b"], "dropped": ["c"]},
        {"event": "round_completed", "round": 2, "contributors": ["a", "c"], "failed": ["b"]},
    ]
    (tmp_path / "run" / "audit.jsonl").write_text("\n".join(json.dumps(a) for a in audit))
    page = write_report(tmp_path / "run")
    text = page.read_text()
    assert "final accuracy" in text and "fedtrain.examples:BreastCancerTask" in text
    assert text.count("<tr><td>") == 3  # one row per round
    for name in ("accuracy.png", "bytes.png", "participation.png"):
        data = (page.parent / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5_000, name
        assert f'src="{name}"' in text
    assert not (page.parent / "epsilon.png").exists()  # no DP in this run


def test_participation_table():
    table = participation(
        [
            {"event": "round_completed", "round": 1, "contributors": ["a"], "dropped": ["b"]},
            {"event": "join", "site": "z"},
        ]
    )
    assert table == {"a": {1: "trained"}, "b": {1: "dropped"}}


def test_epsilon_plot_when_dp_was_on(tmp_path):
    lines = [
        {
            "round": r,
            "accuracy": 0.5,
            "loss": 1.0,
            "epsilon": 0.3 * r,
            "delta": 1e-5,
            "bytes": 10,
            "seconds": 0.1,
            "clients": 2,
        }
        for r in (1, 2)
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    page = write_report(tmp_path)
    assert (page.parent / "epsilon.png").read_bytes().startswith(PNG)
    assert "epsilon 0.600" in page.read_text()


def test_not_a_run_directory(tmp_path):
    with pytest.raises(ConfigError, match="missing or empty"):
        write_report(tmp_path)
    with pytest.raises(ConfigError, match="not a run directory"):
        write_report(tmp_path / "nope")


def test_report_of_a_live_run_leaves_out_the_line_being_written(tmp_path):
    """`fedtrain report` may run while the server appends a round's line (or after a
    crash cut one short): the partial line is left out, the rounds before are shown."""
    lines = [json.dumps({"round": r, "accuracy": 0.5, "loss": 1.0}) for r in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"round": 3, "accu')
    (tmp_path / "audit.jsonl").write_text('{"event": "round_completed", "round": 1, "contr')
    text = write_report(tmp_path).read_text()
    assert text.count("<tr><td>") == 2
    assert "<th>rounds completed</th><td>2</td>" in text


def test_report_of_a_federated_evaluation_names_the_worst_site_and_plots_each_one(tmp_path):
    config = from_dict(
        SimConfig,
        {
            "task": "fedtrain.examples:SyntheticTask",
            "task_options": {"num_train": 600, "num_test": 0},  # no test set
            "eval_fraction": 0.25,
            "rounds": 3,
            "num_clients": 4,
            "partition": {"kind": "quantity", "alpha": 1.0},
            "run_dir": str(tmp_path / "run"),
            "client": {"lr": 0.1},
        },
    )
    last = run_simulation(config).history[-1]
    text = write_report(tmp_path / "run").read_text()
    assert f"{last['accuracy']:.4f} (federated: 4 sites)" in text
    assert f"{last['worst_site']}: accuracy {last['worst_accuracy']:.4f}" in text
    data = (tmp_path / "run" / "report" / "site_accuracy.png").read_bytes()
    assert data.startswith(PNG) and len(data) > 5_000
    assert 'src="site_accuracy.png"' in text


def test_a_run_directory_written_before_the_one_record_still_renders(tmp_path):
    """Old simulation lines said `clients` for the clients *selected* and counted
    `dropped`; old deployment lines named them. Both render in today's meanings,
    beside a line of today's format."""
    old_sim = {"round": 1, "clients": 20, "reported": 15, "dropped": 5, "rejected": 0}
    old_deployment = {"round": 2, "clients": 2, "selected": 3, "dropped": ["c"], "failed": []}
    new = {
        **{"record_version": 2, "round": 3, "attempts": 1, "selected": 3, "clients": 3},
        **{"contributors": ["a", "b", "c"], "dropped": [], "failed": [], "skipped": []},
        **{"aggregated": True, "seconds": 0.5, "loss": 0.3, "accuracy": 0.9},
    }
    lines = [{**line, "bytes": 10, "seconds": 0.5} for line in (old_sim, old_deployment)]
    rows = [json.dumps(line) for line in (*lines, new)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows))
    text = write_report(tmp_path).read_text()
    header = "<tr><th>round</th><th>accuracy</th><th>loss</th><th>selected</th><th>clients</th>"
    assert header + "<th>dropped</th><th>failed</th>" in text
    # round 1: 20 selected, 15 counted, 5 dropped (a count: the names were never written)
    assert "<td>1</td><td></td><td></td><td>20</td><td>15</td><td>5</td><td>0</td>" in text
    assert "<td>2</td><td></td><td></td><td>3</td><td>2</td><td>1</td><td>0</td>" in text
    assert "<td>3</td><td>0.9</td><td>0.3</td><td>3</td><td>3</td><td>0</td><td>0</td>" in text
    assert "<th>final accuracy</th><td>0.9000</td>" in text


def test_report_of_a_personalized_evaluation_draws_both_curves_and_states_the_final_one(
    tmp_path,
):
    raw = {
        "task": "fedtrain.examples:SyntheticTask",
        "task_options": {"num_train": 600, "num_test": 0},
        "eval_fraction": 0.25,
        "rounds": 3,
        "num_clients": 4,
        "partition": {"kind": "labels", "labels_per_client": 1},
        "client": {"lr": 0.1},
    }
    for name, epochs in (("run", 2), ("plain", 0)):
        config = {**raw, "personalize_epochs": epochs, "run_dir": str(tmp_path / name)}
        history = run_simulation(from_dict(SimConfig, config)).history
        if epochs:
            last = history[-1]
    text = write_report(tmp_path / "run").read_text()
    assert (
        f"<th>final personalized accuracy</th><td>{last['personalized_accuracy']:.4f} "
        f"(fine-tuned at the sites: {last['eval_examples']} of {last['eval_examples']} "
        "held-out examples)</td>" in text
    )
    assert "<th>personalized_accuracy</th>" in text
    assert "personalized_accuracy" not in write_report(tmp_path / "plain").read_text()
    for name in ("accuracy.png", "site_accuracy.png"):  # the same global curves, plus dashed
        mine = (tmp_path / "run" / "report" / name).read_bytes()
        theirs = (tmp_path / "plain" / "report" / name).read_bytes()
        assert mine.startswith(PNG) and mine != theirs
