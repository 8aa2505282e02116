"""`fedtrain demo`: a real deployment on this machine, end to end.

A fresh federation CA issues a server certificate for 127.0.0.1 and one certificate
per site; a server process and one daemon process per site are started exactly as an
operator would start them (`fedtrain server` / `fedtrain client` with TOML files), over
mutual TLS on a free local port. Secure aggregation is on unless asked otherwise: the
server only ever learns the sum of the four updates, and every site requires that
(`require_secagg`), so none would train for a server that could see its update. The
server reports each round as a JSON line on its stdout, which drives the progress
display. Every process is stopped on the way out, whatever happens (including Ctrl-C).

The server holds no data: each site holds out a fifth of its digits, and every round
the sites evaluate the new global model on them (federated evaluation,
`evaluate = "sites"`). Under secure aggregation the evaluation is secure too: the
sites' loss sums, correct counts and example counts are masked like their updates,
so the server records the federation's accuracy and nothing per site. The demo runs
every site, so it reads each site's own log and also names the worst site (what a
federation's operator learns only by asking the sites). Without secure aggregation
(`--no-secagg`) the server records each site's accuracy itself.

A site that dies mid-round is a dropout: secure aggregation over four sites tolerates
one, and the round completes with the other three (`min_fit_clients = 3`). The demo
then starts the site again, as its service manager would, and it rejoins for the next
round (every round starts once all four are connected).
"""

from __future__ import annotations

import json
import logging
import re
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedtrain.errors import FedtrainError
from fedtrain.runtime import tls
from fedtrain.runtime.lifecycle import ProcessGroup

log = logging.getLogger(__name__)

NUM_SITES = 4
#: Updates a round needs: with 4 sites under classic SecAgg (k = 3, t = 3) one site
#: may drop out at any stage and the round still completes with the other three.
MIN_FIT = NUM_SITES - 1
#: How often a site that exits is started again before the demo gives up on it.
SITE_RESTARTS = 3
SITE_RESTART_DELAY_S = 1.0
DIGITS = {
    "task": "fedtrain.examples:DigitsTask",
    "partition": {"kind": "dirichlet", "alpha": 0.5},
    "client": {"epochs": 2, "batch_size": 16, "lr": 0.05, "momentum": 0.9},
}
#: Secure aggregation for the demo: 4 sites of a few hundred digits each. A small
#: max_clients leaves 28 bits per value; the mean's quantization error is then below
#: 1e-6 per weight (see fedtrain.secagg.quantize), far under what training notices.
DEMO_SECAGG = {"enabled": True, "clip": 1.0, "max_clients": 16, "max_weight": 10_000.0}


#: What a site daemon logs after evaluating a model on its held-out set
#: (`SiteDaemon._held_out`): version, examples, loss, accuracy.
HELD_OUT_LINE = re.compile(
    r"model (\w+) on the held-out set \((\d+) examples\): loss (\S+) \{'accuracy': ([^,}]+)"
)


def sites_own_accuracy(logs: Path, names: Sequence[str]) -> dict[str, float]:
    """Each site's accuracy on its own held-out set for the last model version most of
    them evaluated, read from the sites' own logs. The demo runs every site, so it may
    read them; under secure aggregation the server never learns these figures."""
    last: dict[str, tuple[str, float]] = {}
    for name in names:
        path = logs / f"{name}.log"
        found = HELD_OUT_LINE.findall(path.read_text(errors="replace")) if path.exists() else []
        if found:
            last[name] = (found[-1][0], float(found[-1][3]))
    if not last:
        return {}
    final = Counter(version for version, _ in last.values()).most_common(1)[0][0]
    return {name: acc for name, (version, acc) in last.items() if version == final}


class DemoFailed(FedtrainError):
    """A demo process failed; the message carries the end of its log."""


@dataclass
class DemoResult:
    history: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    directory: Path | None = None
    secagg: bool = True
    #: Each site's final accuracy from its own log (`sites_own_accuracy`).
    site_accuracy: dict[str, float] = field(default_factory=dict)

    @property
    def final_accuracy(self) -> float | None:
        final = self.final_evaluation
        return final["accuracy"] if final is not None else None

    @property
    def final_evaluation(self) -> dict[str, Any] | None:
        """The last round record with an accuracy (its `worst_site`, `eval_sites`, ...)."""
        evaluated = [r for r in self.history if r.get("accuracy") is not None]
        return evaluated[-1] if evaluated else None


# -- helpers (also used by the runtime tests) ---------------------------------------------
def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS considers free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dump_toml(data: Mapping[str, Any]) -> str:
    """TOML text for what server/site.toml hold: scalars and lists, top-level mappings
    as `[tables]`, mappings inside those as inline tables."""
    lines: list[str] = []
    tables: list[tuple[str, Mapping[str, Any]]] = []
    for key, value in data.items():
        if isinstance(value, Mapping):
            tables.append((key, value))
        else:
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for name, table in tables:
        lines += ["", f"[{_toml_key(name)}]"]
        lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines).strip() + "\n"


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str | Path):
        return json.dumps(str(value))  # a JSON string is a valid TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        items = ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    raise ValueError(f"cannot write {value!r} to TOML")


def fedtrain_command(*args: str) -> list[str]:
    """`fedtrain ...` run with this interpreter (no dependence on PATH)."""
    return [sys.executable, "-m", "fedtrain.cli", *args]


def tail(path: Path, lines: int = 15) -> str:
    if not path.exists():
        return "(no log)"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


# -- the demo -------------------------------------------------------------------------------
def write_deployment(
    root: Path, rounds: int, port: int, run_dir: Path, *, secagg: bool = True
) -> tuple[Path, list[Path]]:
    """PKI and TOML files for one server and NUM_SITES sites under `root`."""
    ca_dir = root / "pki" / "ca"
    tls.init_ca(ca_dir, name="fedtrain-demo-ca", days=3)
    server_cert, server_key = tls.issue_server(
        ca_dir, root / "pki" / "server", ["127.0.0.1"], days=2
    )
    names = [f"site-{i}" for i in range(NUM_SITES)]
    address = f"127.0.0.1:{port}"
    server_toml = root / "server.toml"
    server_toml.write_text(
        dump_toml(
            {
                "task": DIGITS["task"],
                "address": address,
                "run_dir": str(run_dir),
                "rounds": rounds,
                "round_timeout_s": 120.0,
                "allowed_sites": names,
                # the server holds no test set: the sites evaluate (securely under secagg)
                "evaluate": "sites",
                "client": DIGITS["client"],
                # Every round starts with all four sites (min_available_clients) and
                # completes with three if one drops out on the way (min_fit_clients).
                "strategy": {"min_fit_clients": MIN_FIT, "min_available_clients": NUM_SITES},
                "tls": {"ca": ca_dir / tls.CA_CERT, "cert": server_cert, "key": server_key},
                "secagg": DEMO_SECAGG if secagg else {"enabled": False},
            }
        )
    )
    site_tomls = []
    for i, name in enumerate(names):
        cert, key = tls.issue_site(ca_dir, root / "pki" / name, name, days=2)
        path = root / f"{name}.toml"
        path.write_text(
            dump_toml(
                {
                    "task": DIGITS["task"],
                    "server": address,
                    "require_secagg": secagg,
                    "data": {
                        **DIGITS["partition"],
                        "partition": i,
                        "num_partitions": NUM_SITES,
                        "eval_fraction": 0.2,  # this site's held-out digits
                    },
                    "reconnect": {"min_s": 0.2, "max_s": 2.0},
                    "tls": {"ca": ca_dir / tls.CA_CERT, "cert": cert, "key": key},
                }
            )
        )
        site_tomls.append(path)
    return server_toml, site_tomls


def run_demo(
    directory: Path,
    rounds: int = 10,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    timeout_s: float = 300.0,
    *,
    secagg: bool = True,
) -> DemoResult:
    """Run the digits federation in `directory` (PKI, configs, logs, `run/`)."""
    started = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    logs = directory / "logs"
    logs.mkdir(exist_ok=True)
    run_dir = directory / "run"
    server_toml, site_tomls = write_deployment(
        directory, rounds, free_port(), run_dir, secagg=secagg
    )
    result = DemoResult(directory=directory, secagg=secagg)
    failure: list[str] = []
    with ProcessGroup() as procs:
        server = procs.start(
            "server",
            fedtrain_command("server", "--config", str(server_toml), "--progress-jsonl"),
            log_path=logs / "server.log",
            stdout_pipe=True,
        )
        for path in site_tomls:
            procs.start(
                path.stem,
                fedtrain_command("client", "--config", str(path)),
                log_path=logs / f"{path.stem}.log",
            )

        def abort(reason: str) -> None:
            if server.poll() is None:
                failure.append(reason)
                procs.send_signal("server")

        def supervise(name: str) -> None:
            """Start a site that exits again, as its service manager would (the round it
            was in goes on without it; it rejoins for the next), up to SITE_RESTARTS times."""
            for restart in range(SITE_RESTARTS + 1):
                code = procs.procs[name].wait()
                if server.poll() is not None:
                    return  # the run is over; sites leave with it
                if restart == SITE_RESTARTS:
                    abort(
                        f"{name} exited {restart + 1} times, last with status {code}:\n"
                        f"{tail(logs / f'{name}.log')}"
                    )
                    return
                log.warning(
                    "%s exited with status %s; the round goes on without it, and it is "
                    "started again in %.0fs",
                    name,
                    code,
                    SITE_RESTART_DELAY_S,
                )
                time.sleep(SITE_RESTART_DELAY_S)
                if server.poll() is not None or procs.restart(name) is None:
                    return

        for path in site_tomls:
            threading.Thread(target=supervise, args=(path.stem,), daemon=True).start()
        timer = threading.Timer(timeout_s, abort, args=(f"the demo took over {timeout_s:.0f}s",))
        timer.daemon = True
        timer.start()
        try:
            assert server.stdout is not None
            for line in server.stdout:  # one JSON line per finished round, until the server exits
                record = json.loads(line)
                result.history.append(record)
                if on_round is not None:
                    on_round(record)
            code = server.wait()
        finally:
            timer.cancel()
        if failure:
            raise DemoFailed(f"{failure[0]}\nserver log:\n{tail(logs / 'server.log')}")
        if code != 0:
            raise DemoFailed(f"the server exited with status {code}:\n{tail(logs / 'server.log')}")
    result.seconds = time.perf_counter() - started
    result.site_accuracy = sites_own_accuracy(logs, [path.stem for path in site_tomls])
    return result
