"""`fedtrain` command line: simulate | demo | server | client | status | report | export | ca.

The CLI parses flags, sets up logging and turns `FedtrainError`s into one clear line
and exit status 2; the work itself lives in the library.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from fedtrain.config import from_dict, load_toml
from fedtrain.errors import FedtrainError

log = logging.getLogger("fedtrain.cli")

DIGITS_DEMO = {
    "task": "fedtrain.examples:DigitsTask",
    "rounds": 10,
    "num_clients": 4,
    "partition": {"kind": "dirichlet", "alpha": 0.5},
    "strategy": {"min_fit_clients": 4, "min_available_clients": 4},
    "client": {"epochs": 2, "batch_size": 16, "lr": 0.02, "momentum": 0.9},
}


def setup_logging(verbose: bool = False, json_lines: bool = False) -> None:
    """Rich handler in a terminal, plain lines otherwise (libraries never print)."""
    level = logging.DEBUG if verbose else logging.INFO
    root = logging.getLogger()
    root.handlers.clear()
    if json_lines:
        from fedtrain.observability.logs import JsonFormatter

        handler: logging.Handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
    elif sys.stderr.isatty():
        from rich.logging import RichHandler

        handler = RichHandler(show_path=False, rich_tracebacks=False)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger("fedtrain").setLevel(level)


# -- simulate ---------------------------------------------------------------------------
def _sim_config(raw: dict, args: argparse.Namespace):
    from fedtrain.simulation import SimConfig

    raw = dict(raw)
    for key in ("task", "rounds", "num_clients", "seed", "run_dir", "device", "backend", "workers"):
        value = getattr(args, key, None)
        if value is not None:
            raw[key] = value
    return from_dict(SimConfig, raw)


def run_sim(config, title: str) -> float | None:
    """Run a simulation with a live progress display; returns the final accuracy."""
    from fedtrain.observability.progress import RoundProgress
    from fedtrain.simulation import run_simulation

    with RoundProgress(config.rounds, title) as progress:
        result = run_simulation(config, on_round=progress.update, on_progress=progress.clients)
    acc = result.final_accuracy
    log.info("run directory: %s", Path(config.run_dir).resolve())
    return acc


def cmd_simulate(args: argparse.Namespace) -> int:
    raw = load_toml(args.config) if args.config else {}
    config = _sim_config(raw, args)
    # `kill` (SIGTERM) unwinds like Ctrl-C, so worker pools are stopped on the way out.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    acc = run_sim(config, "simulate")
    print(f"final accuracy: {acc:.4f}" if acc is not None else "finished (no test set)")
    return 0


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def cmd_demo(args: argparse.Namespace) -> int:
    """Digits across 4 sites: a real server and 4 site daemons over mutual TLS on 127.0.0.1."""
    from fedtrain.observability.progress import RoundProgress
    from fedtrain.runtime.demo import run_demo

    directory = Path(args.run_dir or tempfile.mkdtemp(prefix="fedtrain-demo-"))
    rounds = args.rounds if args.rounds is not None else DIGITS_DEMO["rounds"]
    title = "demo (secure aggregation)" if args.secagg else "demo"
    with RoundProgress(rounds, title) as progress:
        result = run_demo(directory, rounds=rounds, on_round=progress.update, secagg=args.secagg)
    log.info(
        "demo finished in %.1fs (secure aggregation %s); everything is in %s",
        result.seconds,
        "on" if result.secagg else "off",
        directory.resolve(),
    )
    final = result.final_evaluation
    if final is None:
        print("finished (no evaluation)")
        return 0
    sites = final.get("eval_sites")
    print(f"final accuracy: {final['accuracy']:.4f} (federated: {sites} sites' held-out data)")
    if final.get("worst_accuracy") is not None:
        print(f"worst site: {final['worst_site']}, accuracy {final['worst_accuracy']:.4f}")
    return 0


# -- server / client ----------------------------------------------------------------------
def cmd_server(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from fedtrain.runtime.allocator import tune_allocator

    tune_allocator()  # before torch is imported (see its docstring)

    from fedtrain.observability.progress import RoundProgress
    from fedtrain.runtime.config import load_server_config
    from fedtrain.runtime.lifecycle import stop_on_signals
    from fedtrain.runtime.server.app import AggregationServer

    config = load_server_config(args.config)
    if args.resume is not None:
        config = dataclasses.replace(config, run_dir=str(args.resume))
    resume = args.resume is not None
    if args.resume_if_present:
        resume = _resume_decision(config.run_dir, config.rounds)
        if resume is None:
            return 0

    progress = RoundProgress(config.rounds, "server", live=False)  # log lines with an ETA

    def on_round(record: dict) -> None:
        progress.update(record)
        if args.progress_jsonl:
            print(json.dumps(record, sort_keys=True), flush=True)

    with _server_observers(config, resume, on_round) as observe:
        server = AggregationServer(config, insecure=args.insecure, resume=resume, on_round=observe)
        server.audit.subscribe(observe.on_audit)
        observe.tag(
            run_id=server.coordinator.run_id, task_fingerprint=server.coordinator.fingerprint
        )
        with stop_on_signals(server.coordinator.stop):
            server.start()
            try:
                server.wait()
            finally:
                server.stop()
        done = server.coordinator.global_model.round
        if server.coordinator.error is not None:
            observe.outcome = "FAILED"
        elif done < config.rounds:
            observe.outcome = "KILLED"  # stopped; --resume continues the same MLflow run
    if server.coordinator.error is not None:
        print(f"error: {server.coordinator.error}", file=sys.stderr)
        return 1
    if done < config.rounds:
        log.info(
            "stopped after round %d of %d; continue with --resume %s",
            done,
            config.rounds,
            server.run_dir.path,
        )
    return 0


def _server_observers(config, resume: bool, on_round):
    """The server's MLflow tracker (TensorBoard and Prometheus live in the server), with
    `on_round` after it."""
    import dataclasses

    from fedtrain.observability.observers import observing

    return observing(  # the fingerprint and run id are tagged once the server has them
        config.run_dir,
        tracking=config.tracking,
        params=dataclasses.asdict(config),
        tags=lambda: {"fedtrain.driver": "server", "fedtrain.task": config.task},
        then=on_round,
        resume=resume,
    )


def _resume_decision(run_dir: str, rounds: int) -> bool | None:
    """--resume-if-present: resume (True), start (False), or nothing to do (None), by
    `RunDir.progress`, the one rule the systemd unit restarts by."""
    from fedtrain.run_dir import RunDir, RunProgress

    run = RunDir(run_dir)
    progress = run.progress(rounds)
    if progress is RunProgress.COMPLETE:
        log.info(
            "the run in %s is complete (%d rounds; final model %s): nothing to do. To train "
            "again, set run_dir to a new directory (or raise rounds to continue this run)",
            run.path,
            rounds,
            run.model_path,
        )
        return None
    if progress is RunProgress.NOT_STARTED:
        # Lines of a first round that crashed before its checkpoint: it runs again.
        if dropped := run.settle_metrics(0)[0]:
            log.warning(
                "no checkpoint in %s: starting the run; %d metrics line(s) of a round that "
                "never reached its checkpoint dropped",
                run.path,
                dropped,
            )
        return False
    return True


def cmd_client(args: argparse.Namespace) -> int:
    """Run a site daemon until it is stopped (or the run is done, with --exit-when-done);
    then end the process at once (`fedtrain.teardown`)."""
    import dataclasses

    from fedtrain.runtime.allocator import tune_allocator

    tune_allocator()  # before torch is imported (see its docstring)
    log.info("starting the site (%s): loading torch and fedtrain's runtime", args.config)
    from fedtrain.runtime.config import load_site_config
    from fedtrain.runtime.lifecycle import stop_on_signals
    from fedtrain.runtime.site.daemon import SiteDaemon, site_name
    from fedtrain.runtime.site.workers import run_follower, torchrun_follower, with_workers
    from fedtrain.teardown import leave_now

    config = with_workers(load_site_config(args.config), devices=args.devices, nproc=args.nproc)
    if args.exit_when_done:
        config = dataclasses.replace(config, exit_when_done=True)
    if torchrun_follower():  # a rank > 0 of a multi-machine site: rank 0 is the daemon
        return run_follower(config, site_name(config, insecure=args.insecure))
    log.info("loading task %s", config.task)  # the task's own imports may take a while
    daemon = SiteDaemon(config, insecure=args.insecure)
    with stop_on_signals(daemon.stop):
        daemon.run()
    if daemon.fatal is not None:
        print(f"error: {daemon.fatal}", file=sys.stderr)
        leave_now(1)
    leave_now(0)  # the group, channels and threads are closed; nothing else to wait for


def _device_list(text: str) -> list[str]:
    """`--devices cuda:0,cuda:1` as a list of device names."""
    devices = [d.strip() for d in text.split(",") if d.strip()]
    if not devices:
        raise argparse.ArgumentTypeError("list GPUs separated by commas, e.g. cuda:0,cuda:1")
    return devices


# -- status ------------------------------------------------------------------------------
def cmd_status(args: argparse.Namespace) -> int:
    """Ask a running server where its federation stands (the Status RPC)."""
    from rich.console import Console

    from fedtrain.observability.status import render_rich, render_text
    from fedtrain.runtime.status import SitePage, fetch_status

    if not args.verbose:  # the answer goes to stdout; keep "TLS: ..." info lines out of it
        logging.getLogger("fedtrain").setLevel(logging.WARNING)
    address, identity, server_name = _status_target(args)
    page = SitePage(args.sites_from, args.sites)
    state = fetch_status(
        address, identity, server_name=server_name, timeout_s=args.timeout, page=page
    )
    if args.json:
        print(state.to_json())
    elif sys.stdout.isatty():
        render_rich(state, Console())
    else:
        print(render_text(state))
    return 0


def _status_target(args: argparse.Namespace):
    """(address, client identity or None, TLS server name) from the flags / site.toml."""
    from fedtrain.errors import ConfigError
    from fedtrain.runtime.peer_auth import client_identity

    if args.run_dir is not None:  # the server's own host: its owner-only local socket
        tls_flags = (args.server, args.config, args.insecure, args.ca, args.cert, args.key)
        if any(tls_flags) or args.server_name:
            raise ConfigError(
                "--run-dir asks the server's local status socket (no TLS); it excludes "
                "--server, --config, --insecure, --server-name and --ca/--cert/--key"
            )
        from fedtrain.runtime.server.local_status import socket_address, trusted_socket

        trusted_socket(args.run_dir)
        return socket_address(args.run_dir), None, ""
    site = None
    if args.config:  # only its server and [tls]: no torch (the whole schema imports it)
        from fedtrain.runtime.tls_config import read_site_server

        site = read_site_server(args.config)
    address = args.server or (site.server if site else None)
    if not address:
        raise ConfigError(
            "fedtrain status needs --server HOST:PORT (or --config site.toml, or --run-dir "
            "RUN_DIR on the server's host)"
        )
    if args.insecure:
        if args.ca or args.cert or args.key:
            raise ConfigError("--insecure and --ca/--cert/--key exclude each other; pick one")
        return address, None, ""
    ca, cert, key = args.ca, args.cert, args.key
    if site is not None:
        ca, cert, key = ca or site.tls.ca, cert or site.tls.cert, key or site.tls.key
    if not (ca and cert and key):
        raise ConfigError(
            "fedtrain status needs --ca, --cert and --key: the federation's ca.crt and a "
            "certificate it issued (the operator's own: `fedtrain ca issue-site --ca-dir ca "
            "--name operator --out operator`), or --config site.toml at a site; --insecure "
            "only for a server started with --insecure"
        )
    server_name = args.server_name or (site.tls.server_name if site else "")
    return address, client_identity(cert, key, ca), server_name


# -- report ------------------------------------------------------------------------------
def cmd_report(args: argparse.Namespace) -> int:
    from fedtrain.observability.report import write_report

    page = write_report(args.run_dir)
    print(f"report: {page} (plots beside it)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from fedtrain.export import SIDECAR, export_run

    path = export_run(args.run_dir, args.out, checkpoint=args.checkpoint)
    print(f"exported {path} and {path.with_name(SIDECAR)}")
    return 0


# -- ca ----------------------------------------------------------------------------------
def cmd_ca(args: argparse.Namespace) -> int:
    from fedtrain.runtime import tls

    if args.ca_command == "init":
        path = tls.init_ca(args.ca_dir, name=args.name, days=args.days)
        print(f"created federation CA {path} (keep {Path(args.ca_dir) / tls.CA_KEY} secret)")
    elif args.ca_command == "issue-server":
        cert, key = tls.issue_server(args.ca_dir, args.out, args.hostname, days=args.days)
        print(f"issued server certificate {cert} and key {key}")
    elif args.ca_command == "issue-site":
        cert, key = tls.issue_site(args.ca_dir, args.out, args.name, days=args.days)
        print(f"issued site certificate {cert} and key {key}; give the site its folder {args.out}")
    else:  # check
        info = tls.check_certificate(args.cert, args.ca, purpose=args.purpose, key_path=args.key)
        print(
            f"{info.path}: {info.purpose} certificate for {info.common_name}, valid "
            f"{info.not_valid_before:%Y-%m-%d} to {info.not_valid_after:%Y-%m-%d}, OK"
        )
    return 0


# -- parser ----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedtrain", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--log-json", action="store_true", help="JSON-lines logs on stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("simulate", help="run virtual clients on this machine")
    sim.add_argument("--config", type=Path, help="sim.toml (see simulations/)")
    sim.add_argument("--task", help="override `task`, e.g. fedtrain.examples:BreastCancerTask")
    sim.add_argument("--rounds", type=int, help="override `rounds`")
    sim.add_argument("--num-clients", dest="num_clients", type=int, help="override `num_clients`")
    sim.add_argument("--seed", type=int, help="override `seed`")
    sim.add_argument("--run-dir", dest="run_dir", help="override `run_dir`")
    sim.add_argument("--device", help="override `device`")
    sim.add_argument("--backend", choices=["inline", "process", "ray"], help="override `backend`")
    sim.add_argument("--workers", type=int, help="override `workers` (0: one per core)")
    sim.set_defaults(func=cmd_simulate)

    demo = sub.add_parser("demo", help="federate the digits CNN across 4 sites")
    demo.add_argument("--rounds", type=int, help="number of rounds (default 10)")
    demo.add_argument("--run-dir", dest="run_dir", help="keep the run here (default: a temp dir)")
    demo.add_argument(
        "--no-secagg",
        dest="secagg",
        action="store_false",
        help="plain FedAvg: the server sees each site's update (secure aggregation is the default)",
    )
    demo.set_defaults(func=cmd_demo)

    server = sub.add_parser("server", help="run the aggregation server")
    server.add_argument("--config", type=Path, required=True, help="server.toml")
    resume = server.add_mutually_exclusive_group()
    resume.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its last checkpoint",
    )
    resume.add_argument(
        "--resume-if-present",
        dest="resume_if_present",
        action="store_true",
        help="continue the run in the config's run_dir if it has a checkpoint, start it if "
        "not, exit 0 if it is complete (for service managers: server/fedtrain-server.service)",
    )
    server.add_argument(
        "--insecure",
        action="store_true",
        help="no TLS (local tests only: anyone can join as any site)",
    )
    server.add_argument(
        "--progress-jsonl",
        dest="progress_jsonl",
        action="store_true",
        help="print each round's metrics as one JSON line on stdout",
    )
    server.set_defaults(func=cmd_server)

    client = sub.add_parser("client", help="run a site daemon")
    client.add_argument("--config", type=Path, required=True, help="site.toml")
    client.add_argument(
        "--insecure",
        action="store_true",
        help="no TLS (local tests only; the server must run --insecure too)",
    )
    client.add_argument(
        "--exit-when-done",
        dest="exit_when_done",
        action="store_true",
        help="exit (status 0) when the server says its run is complete, instead of waiting "
        "for its next run (sets `exit_when_done`; for scripts, CI and Kubernetes Jobs)",
    )
    workers = client.add_mutually_exclusive_group()
    workers.add_argument(
        "--devices",
        type=_device_list,
        metavar="cuda:0,cuda:1",
        help="override `devices` (and `nproc`, `device`): DDP with one worker per GPU (NCCL)",
    )
    workers.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="override `nproc` (and `devices`): DDP on N CPU worker processes (gloo)",
    )
    client.set_defaults(func=cmd_client)

    status = sub.add_parser("status", help="where a running federation stands")
    status.add_argument("--server", metavar="HOST:PORT", help="the server's address")
    status.add_argument(
        "--config", type=Path, help="site.toml: take the server address and [tls] from it"
    )
    status.add_argument(
        "--run-dir",
        dest="run_dir",
        type=Path,
        help="on the server's host: ask through RUN_DIR/status.sock (no TLS, answers "
        "however busy the server is)",
    )
    status.add_argument("--ca", type=Path, help="the federation's ca.crt")
    status.add_argument("--cert", type=Path, help="a certificate issued by that CA")
    status.add_argument("--key", type=Path, help="the key of --cert")
    status.add_argument(
        "--server-name",
        dest="server_name",
        default="",
        help="host name on the server's certificate, when --server uses another name",
    )
    status.add_argument(
        "--insecure", action="store_true", help="no TLS (a server started with --insecure)"
    )
    status.add_argument("--json", action="store_true", help="print the state as JSON")
    status.add_argument(
        "--sites", type=int, default=100, metavar="N", help="list N connected sites (default 100)"
    )
    status.add_argument(
        "--sites-from",
        type=int,
        default=0,
        metavar="K",
        help="list sites from the K-th (0-based, sorted by name)",
    )
    status.add_argument(
        "--timeout", type=float, default=10.0, help="seconds to wait for an answer (default 10)"
    )
    status.set_defaults(func=cmd_status)

    report = sub.add_parser("report", help="plots and an HTML summary of a run directory")
    report.add_argument("run_dir", type=Path, help="a run directory (simulation or server)")
    report.set_defaults(func=cmd_report)

    export = sub.add_parser(
        "export", help="write a run's model as safetensors with its names and a JSON card"
    )
    export.add_argument("run_dir", type=Path, help="a run directory (simulation or server)")
    export.add_argument("--out", type=Path, help="folder to write to (default: the run dir)")
    export.add_argument(
        "--checkpoint",
        action="store_true",
        help="export the last checkpoint even when a final model exists",
    )
    export.set_defaults(func=cmd_export)

    ca = sub.add_parser("ca", help="federation certificate authority")
    ca_sub = ca.add_subparsers(dest="ca_command", required=True)
    init = ca_sub.add_parser("init", help="create a new federation CA")
    init.add_argument("--ca-dir", required=True, type=Path)
    init.add_argument("--name", default="fedtrain-federation-ca")
    init.add_argument("--days", type=int, default=3650)
    srv = ca_sub.add_parser("issue-server", help="certificate for the aggregation server")
    srv.add_argument("--ca-dir", required=True, type=Path)
    srv.add_argument(
        "--hostname",
        action="append",
        required=True,
        help="DNS name or IP sites dial (repeat for several)",
    )
    srv.add_argument("--out", type=Path, required=True, help="folder for server.crt/.key")
    srv.add_argument("--days", type=int, default=825)
    site = ca_sub.add_parser("issue-site", help="certificate for one site")
    site.add_argument("--ca-dir", required=True, type=Path)
    site.add_argument("--name", required=True, help="the site's name (on the allow-list)")
    site.add_argument("--out", type=Path, required=True, help="folder for SITE.crt/.key")
    site.add_argument("--days", type=int, default=825)
    check = ca_sub.add_parser("check", help="check a certificate against the CA")
    check.add_argument("--cert", required=True, type=Path)
    check.add_argument("--ca", required=True, type=Path, help="ca.crt")
    check.add_argument("--key", type=Path, help="also check that this key matches")
    check.add_argument("--purpose", choices=["server", "site"], default="site")
    ca.set_defaults(func=cmd_ca)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose, args.log_json)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except FedtrainError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
