"""`server.toml` and `site.toml`: typed, documented, unknown keys are errors.

Both files are parsed with fedtrain.config, so `reference(ServerConfig)` generates
their documentation. The strategy and partition tables are the simulation's own
dataclasses, so a strategy configured for a simulation works unchanged here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fedtrain.compression.downlink import DOWNLOAD_CODECS
from fedtrain.compression.settings import CompressionSettings, DownloadSettings
from fedtrain.config import from_dict, load_toml, option, section
from fedtrain.errors import ConfigError
from fedtrain.evaluation import (
    CROSS_SITE_DOC,
    CROSS_SITE_LOCAL_DOC,
    EVALUATE_DOC,
    SHARE_LOCAL_MODEL_DOC,
    SITE_METRICS_DOC,
    EvaluateAt,
    check_cross_site,
)
from fedtrain.observability.mlflow_tracking import TrackingConfig
from fedtrain.observability.tensorboard import TENSORBOARD_DOC, TENSORBOARD_SITES_DOC
from fedtrain.personalize import PERSONALIZE_DOC, PERSONALIZE_MAX_DOC, check_epochs
from fedtrain.runtime.tls_config import DEFAULT_ADDRESS, ServerTlsConfig, SiteTlsConfig
from fedtrain.runtime.wire import HEADER_ALLOWANCE, MAX_TRANSFER_STREAMS
from fedtrain.secagg.settings import SecAggSettings
from fedtrain.simulation.config import SCHEDULE_DOC, PartitionConfig, StrategyConfig
from fedtrain.strategy import Schedule, Strategy
from fedtrain.strategy.schedule import check_schedules
from fedtrain.tensors import DEFAULT_CHUNK_BYTES

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


@dataclass
class HeartbeatConfig:
    interval_s: float = option(
        5.0,
        "How often sites send a heartbeat (told to them on join). With many sites the "
        "server asks for longer intervals, so that all heartbeats together stay under "
        "50 per second, and tells sites that joined earlier the longer interval as the "
        "federation grows (liveness comes from keepalive pings and any bytes received).",
    )
    timeout_s: float = option(
        30.0,
        "A site silent this long is disconnected (a dropout if it was training); scaled "
        "with the site's heartbeat interval when the server lengthened it.",
    )
    keepalive_s: float = option(
        60.0,
        "HTTP/2 keepalive: the server pings every site connection this often, and closes "
        "one that does not answer within as long again (the site is then gone: a "
        "crashed host or a cut link is noticed without a message from it). Each ping is "
        "gRPC work: 10,000 sites pinged every 20 s cost 3% of a core at idle.",
    )
    grace_s: float = option(
        90.0,
        "A site whose link fails (its control stream goes silent past timeout_s, or breaks "
        "after it went quiet) stays in its round this much longer, and may rejoin with its "
        "session meanwhile: its round, its upload in flight and its queued messages "
        "continue. Past it the site is dropped and its upload discarded. A stream closed "
        "while the site was talking (its process exited or was killed) drops it at once. "
        "0: no grace, every failure drops the site at once.",
    )


@dataclass
class TransfersConfig:
    """Each chosen site's own deadline, and what the log says about transfers in flight
    (see server/README.md, "Sizing deadlines")."""

    deadline_slack: float = option(
        3.0,
        "Each chosen site gets its own deadline: its estimated round (the model down and "
        "its update up at its measured rates, plus its measured compute time) times this, "
        "plus deadline_floor_s, at most round_timeout_s. A site past it that is stalled or "
        "far slower than measured (under its measured rate / this) is dropped from the "
        "round then, audited with the numbers (`site_dropped`), so the round does not "
        "wait for round_timeout_s on it; one still moving at that rate is kept. Sites "
        "not measured yet have only round_timeout_s; an outage (judged by heartbeat."
        "grace_s) is added to a site's deadline, up to grace_s per round attempt. 0: off "
        "(only round_timeout_s).",
    )
    deadline_floor_s: float = option(
        30.0,
        "Added to every site's own deadline: room for what its estimate cannot know "
        "(a busy moment at the site or the server, latency, a round config that trains "
        "longer). Raise it when rounds' work varies much from one round to the next.",
    )
    stall_s: float = option(
        20.0,
        "A transfer from which no byte arrived (or to which none could be sent) this "
        "long is logged as stalled, once per stall, with how far it got; one idle 3 x "
        "this is cut while another transfer waits for a slot (`transfer cut` in the log, "
        "`transfer_cut` audited): its max_transfers slot goes to that one, and the site "
        "resumes where it stopped. Raise it when a chunk (chunk_bytes) takes longer than "
        "this on your slowest sites' links.",
    )
    progress_after_s: float = option(
        10.0,
        "A transfer running longer than this logs its progress at 25, 50 and 75% (bytes, "
        "rate); shorter ones log nothing. 0: no progress lines.",
    )
    own_upload_connection_sites: int = option(
        1000,
        "With at least this many sites connected, each site sends its update on a "
        "connection of its own and closes it after (its instruction says so; with TLS the "
        "connection joins the session first). gRPC keeps each connection's read buffers "
        "sized by the largest message it carried: at 10,000 sites the control connections "
        "that had carried an update held the server's RSS ~550 MB higher after 10 rounds. "
        "Below it updates go on the site's control connection, whose congestion window is "
        "already open (a new connection costs a long link its handshakes and slow start), "
        "and so do the training sites beyond what the file limit has room for (a "
        "second connection each): an all-10,000 round on a 20,000-file limit sends "
        "9,872 updates on their own connections and 128 on the control ones. 0: never.",
    )
    inline_model_bytes: int = option(
        1 << 20,
        "A model whose download weighs at most this many bytes rides inside each site's "
        "instruction (sites of this version announce they take it): no download call per "
        "site and round (at 1,000 sites a round, a fifth of the server's CPU per round). "
        "Pushed at most max_transfers at a time; a site that waits over a second for its "
        "turn downloads the model as before. Never for a site served changes (`[download] "
        "delta`). 0: never. Capped at chunk_bytes (a site accepts messages that large).",
    )

    def __post_init__(self) -> None:
        if self.inline_model_bytes < 0:
            raise ConfigError(
                f"transfers.inline_model_bytes must be >= 0 (0: never), got "
                f"{self.inline_model_bytes!r}"
            )
        if self.own_upload_connection_sites < 0:
            raise ConfigError(
                "transfers.own_upload_connection_sites must be >= 0 (0: never), got "
                f"{self.own_upload_connection_sites!r}"
            )
        for key in ("deadline_slack", "deadline_floor_s", "progress_after_s"):
            if not getattr(self, key) >= 0:
                raise ConfigError(f"transfers.{key} must be >= 0, got {getattr(self, key)!r}")
        if 0 < self.deadline_slack < 1:
            raise ConfigError(
                f"transfers.deadline_slack = {self.deadline_slack} must be >= 1 (a site "
                "could not even finish at its measured pace), or 0 for no per-site deadlines"
            )
        if not self.stall_s > 0:
            raise ConfigError(f"transfers.stall_s must be > 0, got {self.stall_s!r}")


@dataclass
class SecAggServerSettings(SecAggSettings):
    """The protocol's settings plus the server's deadline for each of its stages."""

    setup_timeout_s: float = option(
        30.0, "Stage 0: sites that have not advertised their keys by then are dropped."
    )
    share_keys_timeout_s: float = option(
        30.0, "Stage 1: sites that have not sent their encrypted shares by then are dropped."
    )
    masked_input_timeout_s: float = option(
        0.0,
        "Stage 2 (local training + the masked upload); 0: until the round's deadline "
        "(round_timeout_s).",
    )
    consistency_timeout_s: float = option(
        30.0,
        "Stage 3 (with consistency_check): how long to wait for the survivors' signatures "
        "of the survivor set; those that have not signed by then are not asked to unmask.",
    )
    unmask_timeout_s: float = option(
        30.0, "Stage 4: how long to wait for the survivors' unmasking shares."
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in (
            "setup_timeout_s",
            "share_keys_timeout_s",
            "consistency_timeout_s",
            "unmask_timeout_s",
        ):
            if not getattr(self, key) > 0:
                raise ConfigError(f"secagg.{key} must be > 0, got {getattr(self, key)!r}")
        if not self.masked_input_timeout_s >= 0:
            raise ConfigError(
                f"secagg.masked_input_timeout_s must be >= 0 (0: the round's deadline), "
                f"got {self.masked_input_timeout_s!r}"
            )


@dataclass
class WeightsConfig:
    """How many examples a site's plain update may count for (see `runtime/server/weights.py`)."""

    max_num_examples: int = option(
        1_000_000_000,
        "Most examples a site not named in weights.sites may declare for one update; "
        "above it the update is refused or clipped (weights.action).",
    )
    sites: dict[str, int] = option(
        {},
        "Per-site caps, site name -> most examples it may declare (e.g. `hospital-a = "
        "12000`): it replaces max_num_examples and the ratio check for that site.",
    )
    max_weight_ratio: float = option(
        100.0,
        "A site not named in weights.sites may declare at most this many times the median "
        "of the other sites' latest admitted weights (this round's, else their last "
        "upload's); 0: no ratio check. The default stops only the absurd: give each site "
        "a cap in weights.sites, or lower this when the sites are of similar size.",
    )
    action: Literal["refuse", "clip"] = option(
        "refuse",
        "A declared weight over its limit: `refuse` the update (the site gets "
        "PERMISSION_DENIED), or `clip` it to the limit and count it so.",
    )

    def __post_init__(self) -> None:
        if self.max_num_examples < 1:
            raise ConfigError(f"weights.max_num_examples must be >= 1, got {self.max_num_examples}")
        if self.max_weight_ratio != 0 and not self.max_weight_ratio >= 1:
            raise ConfigError(
                f"weights.max_weight_ratio = {self.max_weight_ratio} must be >= 1 (a site "
                "at the median must pass), or 0 for no ratio check"
            )
        for site, cap in self.sites.items():
            if cap < 1:
                raise ConfigError(f"weights.sites.{site} = {cap} must be >= 1")

    def check_sites(self, allowed_sites: list[str], secagg: bool) -> None:
        """Per-site caps must name admitted sites, and can only bind plain updates."""
        unknown = sorted(set(self.sites) - set(allowed_sites)) if allowed_sites else []
        if unknown:
            raise ConfigError(
                f"weights.sites names {', '.join(map(repr, unknown))}, not in allowed_sites: "
                "fix the name (a cap for a site that never joins protects nothing)"
            )
        if secagg and self.sites:
            raise ConfigError(
                "weights.sites cannot be enforced under secure aggregation: each site's "
                "example count travels masked; secagg.max_weight is then the cap, applied "
                "by the sites (see the README's security model). Remove weights.sites or "
                "turn secure aggregation off"
            )


@dataclass
class ServerConfig:
    task: str = option(doc="Task installed at the server and the sites, 'package.module:Class'.")
    task_options: dict[str, Any] = option(
        {}, "Keyword arguments for the task's constructor.", env=True
    )
    address: str = option(DEFAULT_ADDRESS, "host:port to listen on ('0.0.0.0:PORT' for all).")
    run_dir: str = option(
        "runs/server", "Directory for config, metrics, audit, checkpoints.", env=True
    )
    rounds: int = option(10, "Number of federated rounds (fedbuff: model versions).")
    seed: int = option(0, "Seed of the initial model and of participant sampling.")
    device: str = option("cpu", "Device for the server-side evaluation of the global model.")
    evaluate: EvaluateAt = option("auto", EVALUATE_DOC)
    eval_every: int = option(1, "Evaluate the global model every N rounds (and after the last).")
    eval_timeout_s: float = option(
        120.0,
        "Federated evaluation: how long the server waits for the chosen sites' reports; "
        "a site that has not answered by then (or left, or failed) is left out of that "
        "round's evaluation, which never fails the round.",
    )
    personalize_epochs: int = option(0, PERSONALIZE_DOC)
    site_metrics: bool = option(True, SITE_METRICS_DOC)
    cross_site_validation: bool = option(False, CROSS_SITE_DOC)
    cross_site_local_models: bool = option(False, CROSS_SITE_LOCAL_DOC)
    round_timeout_s: float = option(
        600.0, "Deadline of a round; the round closes with the updates received by then."
    )
    max_round_attempts: int = option(
        0, "Give up (exit with an error) after this many failed attempts of one round; 0: never."
    )
    allowed_sites: list[str] = option(
        [],
        "Site names admitted (certificate name with TLS, Join name without); "
        "required with TLS, empty admits every site when --insecure.",
    )
    chunk_bytes: int = option(DEFAULT_CHUNK_BYTES, "Raw tensor bytes per streamed message.")
    max_message_bytes: int = option(
        DEFAULT_MAX_MESSAGE_BYTES, "gRPC message size limit; must exceed chunk_bytes + 64 KiB."
    )
    max_sites: int = option(
        0,
        "Most sites connected at once; further joins are refused with a retry-after hint "
        "(audited). 0: as many as the process's file limit allows (the server raises its "
        "soft RLIMIT_NOFILE to the hard limit and keeps room for transfers and files).",
    )
    max_transfers: int = option(
        64,
        "Model downloads and update uploads moved at once; more wait their turn (the "
        "site's stream simply waits), so upload journals and files stay bounded whatever "
        "the number of sites.",
    )
    upload_grace_s: float = option(
        180.0,
        "How long the server keeps the part of an upload it received when the upload's "
        "stream breaks (a link outage): the site resumes from there within this time, "
        "sending only the rest; later it starts again from zero. Keep it above "
        "heartbeat.timeout_s + heartbeat.grace_s, the longest a site may be away.",
    )
    cpu_threads: int = option(
        1,
        "Threads for the server's CPU work (validating and folding chunks, protocol "
        "messages; also torch's thread count); connections and streams cost no thread. "
        "Each thread competes with the event loop for Python's lock: with 10,000 sites, 1 "
        "cost 4-7% less server CPU per round of 1,000 than 2, and 100M-parameter rounds "
        "took as long (benchmarks/RESULTS.md).",
    )
    upload_memory_mb: int = option(
        1024,
        "RAM (MiB), shared by the uploads in flight, for the journals that keep each "
        "update until it is whole and folded into the sum; an upload whose whole update "
        "does not fit in what is left journals to a file under the run dir instead (so "
        "models larger than this always do). Server memory is ~2x the model plus this; "
        "0: disk only.",
    )
    metrics_port: int = option(
        0,
        "Serve Prometheus metrics at http://metrics_address:metrics_port/metrics; 0: off.",
    )
    metrics_address: str = option(
        "127.0.0.1",
        "Interface of the metrics endpoint ('0.0.0.0' for all). Plain HTTP without "
        "authentication: expose it only to your monitoring network.",
    )
    status_socket: bool = option(
        True,
        "Also answer Status on RUN_DIR/status.sock (a Unix socket, owner-only, no TLS) "
        "from a thread of its own, so `fedtrain status --run-dir` and probes on the "
        "server's host answer in milliseconds however busy the rounds keep the main port.",
    )
    status_address: str = option(
        "",
        "Also answer Status on this host:port ('0.0.0.0:50052' for all interfaces), from "
        "a thread of its own like status_socket: for `fedtrain status --server HOST:PORT` "
        "and probes on other hosts during busy rounds. Same TLS and certificate check as "
        "the sites' port; only Status is served there. Empty: off.",
    )
    tensorboard: bool = option(False, TENSORBOARD_DOC)
    tensorboard_sites: bool = option(False, TENSORBOARD_SITES_DOC)
    tracking: TrackingConfig = section(TrackingConfig, "Experiment tracking (MLflow).")
    strategy: StrategyConfig = section(StrategyConfig, "The server algorithm.")
    client: dict[str, Any] = option(
        {"epochs": 1, "batch_size": 32, "lr": 0.05},
        "Round config sent to every chosen site (epochs, batch_size, lr, momentum, ...).",
    )
    client_schedule: dict[str, Schedule] = option({}, SCHEDULE_DOC)
    heartbeat: HeartbeatConfig = section(HeartbeatConfig, "Liveness of site connections.")
    transfers: TransfersConfig = section(
        TransfersConfig, "Per-site deadlines from measured links; transfer progress in the log."
    )
    weights: WeightsConfig = section(
        WeightsConfig, "What a site's declared example count may weigh (plain updates)."
    )
    tls: ServerTlsConfig = section(
        ServerTlsConfig, "TLS (ca, cert, key) and how sites prove their certificates."
    )
    secagg: SecAggServerSettings = section(
        SecAggServerSettings, "Secure aggregation (`secagg = true` or a [secagg] table)."
    )
    compression: CompressionSettings = section(
        CompressionSettings,
        'Update codec the sites encode with (`compression = "int8"` or a table); told to '
        "each site when it joins, decoded here before folding. Not with secure aggregation.",
    )
    download: DownloadSettings = section(
        DownloadSettings,
        'How the global model travels to the sites (`download = "fp16"` or a table): offered '
        "to each site that announces it can decode it when it joins (others get the model "
        "in its own dtypes). Works with secure aggregation.",
    )

    def __post_init__(self) -> None:
        _positive(self, "rounds", "eval_every", "chunk_bytes", "max_transfers", "cpu_threads")
        if self.max_sites < 0:
            raise ConfigError(
                f"max_sites must be >= 0 (0: from the file limit), got {self.max_sites}"
            )
        _positive(self, "round_timeout_s", "eval_timeout_s", "upload_grace_s")
        if self.upload_memory_mb < 0:
            raise ConfigError(f"upload_memory_mb must be >= 0, got {self.upload_memory_mb}")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(
                f"metrics_port = {self.metrics_port} must be a TCP port (1..65535), or 0 for "
                "no metrics endpoint"
            )
        if self.max_round_attempts < 0:
            raise ConfigError(f"max_round_attempts must be >= 0, got {self.max_round_attempts}")
        if self.status_address:
            _check_status_address(self.status_address, self.address)
        if self.chunk_bytes + HEADER_ALLOWANCE > self.max_message_bytes:
            raise ConfigError(
                f"max_message_bytes ({self.max_message_bytes}) must be at least chunk_bytes "
                f"({self.chunk_bytes}) + {HEADER_ALLOWANCE}; raise it or lower chunk_bytes"
            )
        _check_heartbeat(self.heartbeat)
        check_epochs(self.personalize_epochs, "personalize_epochs")
        self.weights.check_sites(self.allowed_sites, self.secagg.enabled)
        for key, value in self.client.items():
            if not isinstance(value, bool | int | float | str):
                raise ConfigError(
                    f"client.{key} = {value!r}: round config values must be booleans, "
                    "numbers or strings"
                )
        check_schedules(self.client, self.client_schedule)
        self.compression.check_secagg(self.secagg.enabled)
        check_cross_site(
            self.cross_site_validation, self.cross_site_local_models, self.secagg.enabled
        )
        if self.secagg.enabled:
            self.secagg.check_rounds(self.strategy.name, self.strategy.min_fit_clients)

    def build_strategy(self) -> Strategy:
        """The strategy `[strategy]` names, with `[client]` and `[client_schedule]`."""
        return self.strategy.build(self.client, self.client_schedule, self.rounds)


#: Sources read from files named in site.toml (`fedtrain.datasources`).
FILE_SOURCES = ("parquet", "csv", "imagefolder")


@dataclass
class DataConfig(PartitionConfig):
    """This site's data: a partition of the task's training set, the task's own hook,
    or files read without code (Parquet, CSV, an image folder)."""

    source: Literal["partition", "task", "parquet", "csv", "imagefolder"] = option(
        "partition",
        "`partition`: a slice of task.datasets()[0] (the bundled examples); "
        "`task`: call the task's `site_data(site_name, **options)` hook; `parquet` / "
        "`csv`: a table under `path` (features and label columns); `imagefolder`: one "
        "folder of images per class under `path`. Needs `pip install 'fedtrain[data]'` "
        "for parquet and csv.",
    )
    partition: int = option(0, "Which part of the split this site holds (0-based).")
    num_partitions: int = option(1, "Into how many parts the training set is split.")
    seed: int = option(
        0,
        "Seed of the split (every site of a federation uses the same) and of the "
        "held-out rows of eval_fraction.",
    )
    options: dict[str, Any] = option(
        {}, "Keyword arguments for the task's site_data hook.", env=True
    )
    path: str = option(
        "",
        "parquet: a file or a (Hive-partitioned, e.g. Spark's) folder of files; csv: a "
        "file or a folder of them; imagefolder: the folder holding one folder per class.",
        env=True,
    )
    features: list[str] = option(
        [], "parquet/csv: feature columns, in model input order; []: every column but label."
    )
    label: str = option("", "parquet/csv: the label column (required).")
    classes: list[Any] = option(
        [],
        "Class names in label-index order, the same list at every site: label values "
        "(text or numbers) become their index; imagefolder: the class folders ([]: the "
        "sorted folder names). parquet/csv without it: an integer label is the class "
        "index, a floating one a regression target.",
    )
    eval_path: str = option(
        "",
        "A held-out set with the same layout as `path` (file or folder), for evaluation at "
        "this site; not with eval_fraction.",
        env=True,
    )
    eval_fraction: float = option(
        0.0,
        "Hold out this fraction of the rows (images) under `path`, or of this site's "
        "partition (source = partition), for evaluation (seeded by data.seed, the same "
        "split on every start); 0: none.",
    )
    batch_rows: int = option(
        65536, "parquet/csv: rows decoded per record batch while the files are read."
    )
    image_size: list[int] = option(
        [], "imagefolder: resize every image to [height, width]; []: all must share a size."
    )
    image_mode: Literal["RGB", "L"] = option(
        "RGB", "imagefolder: decode images as RGB (3 channels) or L (grey, 1 channel)."
    )

    def __post_init__(self) -> None:
        if self.num_partitions < 1:
            raise ConfigError(f"data.num_partitions must be >= 1, got {self.num_partitions}")
        if not 0 <= self.partition < self.num_partitions:
            raise ConfigError(
                f"data.partition = {self.partition} must be in [0, {self.num_partitions})"
            )
        reads_files = self.source in FILE_SOURCES
        if reads_files and not self.path:
            raise ConfigError(f"data.source = {self.source!r} needs data.path (a file or folder)")
        if self.source in ("parquet", "csv") and not self.label:
            raise ConfigError(
                f"data.source = {self.source!r} needs data.label, the label column's name"
            )
        if not reads_files:
            stray = [k for k in ("path", "eval_path", "label", "features") if getattr(self, k)]
            if stray:
                raise ConfigError(
                    f"data.{stray[0]} is read only with data.source = parquet, csv or "
                    f"imagefolder (here: {self.source!r})"
                )
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"data.eval_fraction = {self.eval_fraction} must be in [0, 1)")
        if self.eval_fraction and self.eval_path:
            raise ConfigError("set data.eval_path or data.eval_fraction, not both")
        if self.batch_rows < 1:
            raise ConfigError(f"data.batch_rows must be >= 1, got {self.batch_rows}")


@dataclass
class ReconnectConfig:
    min_s: float = option(0.5, "First reconnect delay; doubles per failure (with jitter).")
    max_s: float = option(30.0, "Longest delay between reconnect attempts.")

    def __post_init__(self) -> None:
        if not 0 < self.min_s <= self.max_s:
            raise ConfigError(
                f"reconnect.min_s ({self.min_s}) must be > 0 and <= reconnect.max_s ({self.max_s})"
            )


@dataclass
class SiteConfig:
    task: str = option(doc="Task to run, 'package.module:Class' (the same as the server's).")
    task_options: dict[str, Any] = option(
        {}, "Keyword arguments for the task's constructor.", env=True
    )
    server: str = option(DEFAULT_ADDRESS, "host:port of the aggregation server.")
    name: str = option(
        "",
        "This site's name; required without TLS, optional with it (then it must match "
        "the certificate).",
    )
    device: str = option("cpu", "Device to train on ('cpu', 'cuda', 'cuda:1').")
    devices: list[str] = option(
        [],
        "Train each round with DDP on these GPUs, one worker process per GPU (NCCL), e.g. "
        "['cuda:0', 'cuda:1']; replaces `device`. Workers live across rounds.",
    )
    nproc: int = option(
        1,
        "Train each round with DDP on this many CPU worker processes (gloo); 1 trains in "
        "the daemon's own process. Set `devices` or `nproc`, not both.",
    )
    sharding: Literal["ddp", "fsdp"] = option(
        "ddp",
        "How a worker group (`devices`, `nproc` or torchrun) holds the model: `ddp`, a "
        "whole copy per rank; `fsdp`, sharded across the ranks (torch FSDP2, one unit per "
        "block of the model's ModuleLists) for a model too large for one device; only the "
        "federated tensors are gathered, on rank 0, for the upload.",
    )
    exit_when_done: bool = option(
        False,
        "Exit (status 0) when the server says its run is complete, instead of waiting for "
        "its next run: for scripts, CI and Kubernetes Jobs (`fedtrain client "
        "--exit-when-done` sets it).",
    )
    seed: int = option(
        0,
        "Seed of the site's initial model. Training draws a fresh seed (OS randomness) for "
        "every job, so a round the server runs again never yields the same update twice.",
    )
    require_secagg: bool = option(
        False,
        "Train only for a server that runs secure aggregation: this site's update then "
        "never leaves it unmasked, and it refuses any other server or instruction.",
    )
    share_local_model: bool = option(False, SHARE_LOCAL_MODEL_DOC)
    personalize_max_epochs: int = option(10, PERSONALIZE_MAX_DOC)
    require_consistency_check: bool = option(
        True,
        "With TLS, take part in a secure round only if the server runs the consistency "
        "check (secagg.consistency_check), without which a server that lies about who "
        "dropped out could unmask this site's update. Turn off only to join such a server.",
    )
    max_message_bytes: int = option(
        64 * 1024 * 1024, "gRPC message size limit; must exceed the server's chunk_bytes."
    )
    download_codecs: list[str] = option(
        list(DOWNLOAD_CODECS),
        "Download encodings this site accepts when the server offers one ([download] in "
        "server.toml): fp16, bf16, int8, topk, and delta (changes from the version it "
        "holds). [] : always the model in its own dtypes (exact, more bytes).",
    )
    transfer_streams: int = option(
        0,
        "Parallel streams (separate connections to the server) per model download and "
        "update upload: K flows keep a lossy, long link busy where one TCP flow collapses "
        "(at 1% loss and 40 ms one cubic flow moves ~3 Mbit/s; 64 move 66-70% of a "
        "100 Mbit/s link where one moves 3%). 0 (default): automatic, per transfer and "
        "direction: a transfer starts as one plain call (full speed on a LAN, never a "
        "second connection there); one that would still take > 5 s at its rate (measured "
        "within a second: a transfer's first 4 MiB go in small chunks) is cut where it "
        "stands and continues in ranges over as many streams as that rate says (the "
        "power of 4 at which each moving what the call did would end the rest in 1 s: 64 "
        "at 1% loss; 4 if unmeasured after 1.2 s), then 4 times more at each step: a step "
        "stays if it raises the rate by > 25%, or, once a step at least doubled it (a "
        "flow-limited link), unless it is > 30% slower (a call's step that gains nothing "
        "goes back to one call); the next "
        "transfer starts at the count the last one stayed at (an upload with none yet at "
        "its download's), and one in four tries a quarter as many, kept "
        "only if they move as much (in two windows, on a transfer with room to tell), so a "
        "link that got clean goes back to one call (1% loss: 58-66% of the line rate in the "
        "first round, 64-69% from the second, every transfer at 64 streams). 1: always "
        "one call "
        "(with BBR at the sender one stream is best); K: always K. A transfer under 4 MiB "
        "uses one (site/streams.py; benchmarks/RESULTS.md, 'WAN: parallel streams'). "
        "Masked (secure aggregation) uploads always use one.",
    )
    data: DataConfig = section(DataConfig, "Which data this site trains on.")
    reconnect: ReconnectConfig = section(ReconnectConfig, "Backoff when the server is away.")
    tls: SiteTlsConfig = section(
        SiteTlsConfig, "TLS (ca, cert, key, server_name): the site's certificate and the CA."
    )

    def __post_init__(self) -> None:
        unknown = sorted(set(self.download_codecs) - set(DOWNLOAD_CODECS))
        if unknown:
            raise ConfigError(
                f"download_codecs = {self.download_codecs}: {unknown} unknown; choose from "
                f"{list(DOWNLOAD_CODECS)} ([] for the model in its own dtypes only)"
            )
        if self.nproc < 1:
            raise ConfigError(f"nproc must be >= 1, got {self.nproc}")
        check_epochs(self.personalize_max_epochs, "personalize_max_epochs")
        if not 0 <= self.transfer_streams <= MAX_TRANSFER_STREAMS:
            raise ConfigError(
                f"transfer_streams must be 0 (automatic) to {MAX_TRANSFER_STREAMS}, got "
                f"{self.transfer_streams}"
            )
        if self.devices and self.nproc > 1:
            raise ConfigError(
                f"devices = {self.devices} and nproc = {self.nproc}: set devices (one worker "
                "per GPU) or nproc (CPU workers), not both"
            )
        if self.devices and self.device != "cpu":
            raise ConfigError(
                f"device = {self.device!r} and devices = {self.devices}: set device (train in "
                "the daemon's process) or devices (a DDP worker per GPU), not both"
            )

    @property
    def world_size(self) -> int:
        """Processes that train each round: one per GPU of `devices`, else `nproc`."""
        return len(self.devices) or self.nproc


def _positive(cfg: object, *keys: str) -> None:
    for key in keys:
        value = getattr(cfg, key)
        if not value > 0:
            raise ConfigError(f"{key} must be > 0, got {value!r}")


#: Listen hosts that mean every interface of the machine.
_EVERY_INTERFACE = frozenset({"0.0.0.0", "::", "[::]"})


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a 'host:port' listen address ('[::1]:50052' too), or None."""
    host, sep, port = address.rpartition(":")
    if not (sep and host and port.isdigit() and int(port) <= 65535):
        return None
    return host, int(port)


def _check_status_address(status_address: str, address: str) -> None:
    """A status port is host:port, and not the sites' port (a clash with another
    host's name for this machine is caught when the server binds it)."""
    status = _host_port(status_address)
    if status is None:
        raise ConfigError(
            f"status_address = {status_address!r} is not host:port (e.g. '0.0.0.0:50052' "
            "for every interface); leave it empty for no status port"
        )
    host, port = status
    sites_host, sites_port = _host_port(address) or ("", 0)
    overlap = host == sites_host or {host, sites_host} & _EVERY_INTERFACE
    if port != 0 and port == sites_port and overlap:
        raise ConfigError(
            f"status_address = {status_address!r} is the sites' port (address = "
            f"{address!r}); give the status port a port of its own, e.g. "
            f"'{host}:{port + 1 if port < 65535 else port - 1}'"
        )


def _check_heartbeat(hb: HeartbeatConfig) -> None:
    if not 0 < hb.interval_s < hb.timeout_s:
        raise ConfigError(
            f"heartbeat.interval_s ({hb.interval_s}) must be > 0 and below "
            f"heartbeat.timeout_s ({hb.timeout_s}), or every site would time out"
        )
    if not hb.grace_s >= 0:
        raise ConfigError(f"heartbeat.grace_s must be >= 0 (0: none), got {hb.grace_s!r}")
    if not hb.keepalive_s > 0:
        raise ConfigError(f"heartbeat.keepalive_s must be > 0, got {hb.keepalive_s!r}")


def load_server_config(path: str | Path) -> ServerConfig:
    return from_dict(ServerConfig, load_toml(path))


def load_site_config(path: str | Path) -> SiteConfig:
    return from_dict(SiteConfig, load_toml(path))
