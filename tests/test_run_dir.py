"""fedtrain.run_dir: the metrics a resume settles, and the rule a restart decides by."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedtrain.run_dir import RunDir, RunProgress
from fedtrain.tensors import ModelState


def _lines(run: RunDir) -> list[int]:
    return [r["round"] for r in run.read_metrics()]


@pytest.mark.parametrize(
    ("written", "checkpointed", "carried", "after", "dropped", "restored"),
    [
        ([1, 2, 3], 3, True, [1, 2, 3], 0, False),  # nothing lost: nothing written twice
        ([1, 2, 3, 4], 3, True, [1, 2, 3], 1, False),  # round 4 runs again
        ([1, 2], 3, True, [1, 2, 3], 0, True),  # killed after 3's checkpoint, before its line
        ([1, 2], 3, False, [1, 2], 0, False),  # a checkpoint from before records were carried
        ([1], 0, False, [], 1, False),  # no checkpoint yet: round 1 runs again
    ],
)
def test_settle_metrics_leaves_every_checkpointed_round_once(
    tmp_path: Path,
    written: list[int],
    checkpointed: int,
    carried: bool,
    after: list[int],
    dropped: int,
    restored: bool,
) -> None:
    run = RunDir(tmp_path)
    for r in written:
        run.log_metrics({"round": r, "loss": 1.0 / r})
    record = {"round": checkpointed, "loss": 1.0 / max(checkpointed, 1)} if carried else None
    assert run.settle_metrics(checkpointed, record) == (dropped, restored)
    assert _lines(run) == after
    assert run.settle_metrics(checkpointed, record) == (0, False)  # a second resume: no change


def test_a_line_cut_short_by_a_crash_is_dropped_not_glued_to_the_next(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.log_metrics({"round": 1})
    with run.metrics_path.open("a") as f:
        f.write('{"round": 2, "lo')  # the power went mid-line
    assert _lines(run) == [1]
    assert run.settle_metrics(2, {"round": 2, "loss": 0.5}) == (0, True)
    run.log_metrics({"round": 3})
    assert [json.loads(x)["round"] for x in run.metrics_path.read_text().splitlines()] == [1, 2, 3]


def test_progress_is_read_from_the_checkpoint_and_the_final_model(tmp_path: Path) -> None:
    state = ModelState({"w": torch.ones(3)})
    run = RunDir(tmp_path / "run")
    assert run.progress(3) is RunProgress.NOT_STARTED  # empty: start
    run.log_metrics({"round": 1})
    assert run.progress(3) is RunProgress.NOT_STARTED  # a line, but no checkpoint yet
    run.save_checkpoint(2, state, {}, {})
    assert (run.checkpointed_round(), run.progress(3)) == (2, RunProgress.INTERRUPTED)
    run.save_checkpoint(3, state, {}, {})
    assert run.progress(3) is RunProgress.INTERRUPTED  # last round, final model not saved
    run.save_model(state)
    assert run.progress(3) is RunProgress.COMPLETE
    assert run.progress(5) is RunProgress.INTERRUPTED  # rounds raised: the run continues

    legacy = RunDir(tmp_path / "legacy")  # checkpoint.pt, from before checkpoint.ft
    payload = {"round": 1, "model": dict(state.items()), "strategy": {}, "extra": {}}
    torch.save(payload, legacy.legacy_checkpoint_path)
    assert (legacy.checkpointed_round(), legacy.progress(3)) == (1, RunProgress.INTERRUPTED)
