"""Three hospitals with held-out sets of different sizes (`runtime_support:HeldOutTask`),
for the federated and the secure evaluation tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime_support import Deployment, wait_for

from fedtrain.runtime.demo import fedtrain_command

SITES = ("hospital-a", "hospital-b", "hospital-c")
TASK = "runtime_support:HeldOutTask"


def site_data(i: int) -> dict[str, Any]:
    """Part i of a quantity-skewed split (different sizes), a fifth of it held out."""
    return {
        "kind": "quantity",
        "alpha": 1.0,
        "partition": i,
        "num_partitions": len(SITES),
        "eval_fraction": 0.2,
    }


def kill_one_mid_evaluation(dep: Deployment, marker: Path) -> dict[str, str]:
    """Start the server and the three sites; SIGKILL the last as it starts evaluating
    round 1 (its task touches `marker`, then dawdles), start it again as systemd would,
    and let the run end. Every site's log; the restarted one's as `NAME-again`."""
    dep.start_server()
    for i, name in enumerate(SITES[:2]):
        dep.start_site(name, data=site_data(i))
    slow = SITES[2]
    dep.start_site(
        slow, data=site_data(2), task_options={"eval_marker": str(marker), "eval_delay_s": 60.0}
    )
    wait_for(marker.exists, 120, f"{slow} to start evaluating round 1")
    dep.proc(slow).kill()  # SIGKILL mid-evaluation
    dep.proc(slow).wait(10)
    again = dep.site_toml(slow, data=site_data(2))  # started again, as systemd would
    dep.start_command(
        f"{slow}-again", fedtrain_command("client", "--config", str(again), "--insecure")
    )
    assert dep.wait_server(150) == 0, dep.log("server")
    return {name: dep.log(name) for name in (*SITES, f"{slow}-again")}


def tensorboard_tags(run_dir: Path) -> dict[str, list[str]]:
    """The tags the server wrote under RUN_DIR/tensorboard (`tensorboard = true`)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return events.Tags()
