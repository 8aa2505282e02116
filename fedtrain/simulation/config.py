"""`sim.toml`: what a simulation runs. Every key is documented; unknown keys are errors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fedtrain.compression.settings import CompressionSettings, DownloadSettings
from fedtrain.config import option, section
from fedtrain.errors import ConfigError
from fedtrain.evaluation import (
    CROSS_SITE_DOC,
    EVALUATE_DOC,
    SITE_METRICS_DOC,
    EvaluateAt,
    check_cross_site,
)
from fedtrain.observability.mlflow_tracking import TrackingConfig
from fedtrain.observability.tensorboard import TENSORBOARD_DOC, TENSORBOARD_SITES_DOC
from fedtrain.personalize import PERSONALIZE_DOC, check_epochs
from fedtrain.secagg.settings import SecAggSettings
from fedtrain.strategy import Schedule, Strategy, build_strategy
from fedtrain.strategy.schedule import check_schedules

#: What `client_schedule` means, in sim.toml and server.toml alike.
SCHEDULE_DOC = (
    "How `[client]` values change by round, one table per key, e.g. "
    '`[client_schedule.lr]` with `decay = "cosine"` (see the client_schedule.KEY rows).'
)

#: SecAgg+'s stages, in the order `secagg.stage_dropouts` lists them.
SECAGG_STAGES = ("setup", "share_keys", "masked_input", "consistency", "unmask")


@dataclass
class PartitionConfig:
    kind: Literal["iid", "dirichlet", "shards", "labels", "quantity"] = option(
        "iid",
        "How the task's training set is split among clients: `iid`; `dirichlet` label skew; "
        "`shards`, McMahan et al.'s sort-and-shard (`labels_per_client` shards of the "
        "label-sorted data, so 1 to 2x that many labels); `labels`, exactly "
        "`labels_per_client` labels each; `quantity` (size skew).",
    )
    alpha: float = option(
        0.5, "Dirichlet concentration for `dirichlet` (label skew) and `quantity` (size skew)."
    )
    labels_per_client: int = option(
        2, "`labels`: labels each client holds; `shards`: shards each client holds."
    )


@dataclass
class StrategyConfig:
    name: str = option(
        "fedavg",
        "Server algorithm (see fedtrain.strategy.STRATEGIES), or your own Strategy subclass "
        "as 'package.module:ClassName' (README: 'Your own strategy'); `fedbuff` runs "
        "asynchronously: clients train continuously and every `buffer_size` updates make a "
        "new model version.",
    )
    fraction_fit: float = option(1.0, "Fraction of available clients that train each round.")
    min_fit_clients: int = option(2, "At least this many clients train each round.")
    min_available_clients: int = option(2, "Rounds wait until this many clients exist.")
    fraction_evaluate: float = option(
        1.0,
        "Federated evaluation (evaluate = sites): fraction of the clients able to evaluate "
        "(those holding a held-out set) asked to evaluate each evaluated model.",
    )
    min_evaluate_clients: int = option(
        1, "Federated evaluation: at least this many clients evaluate; fewer: none does."
    )
    options: dict[str, Any] = option(
        {},
        "The algorithm's own options, e.g. proximal_mu (fedprox), server_lr / server_momentum "
        "(fedavgm), server_lr / beta_1 / beta_2 / tau (fedadam, fedyogi, fedadagrad), beta "
        "(fedtrimmedavg), num_malicious / num_to_keep (krum), noise_multiplier / clip_norm / "
        "adaptive_clipping / delta (dpfedavg), buffer_size / server_lr / concurrency / "
        "staleness / staleness_exponent / hinge_slope / hinge_threshold / max_staleness "
        "(fedbuff), bias_correction (fedadam); a user strategy's constructor keywords.",
    )

    def build(self, client: dict[str, Any], schedule: dict[str, Schedule], rounds: int) -> Strategy:
        """The configured strategy, handing out `client` as round config changed by
        `schedule` over `rounds` rounds; a clear error naming a bad option."""
        return build_strategy(
            self.name,
            fraction_fit=self.fraction_fit,
            min_fit_clients=self.min_fit_clients,
            min_available_clients=self.min_available_clients,
            fraction_evaluate=self.fraction_evaluate,
            min_evaluate_clients=self.min_evaluate_clients,
            client_config=client,
            client_schedule={key: s.over(rounds) for key, s in schedule.items()},
            **self.options,
        )


@dataclass
class HeterogeneityConfig:
    epochs_range: list[int] = option(
        [],
        "[min, max] local epochs; each client draws its own once (seeded), overriding "
        "`client.epochs`, as slow and fast devices differ. []: all use `client.epochs`.",
    )
    dropout_rate: float = option(
        0.0,
        "Fraction of each round's chosen clients that never report (seeded; a straggler "
        "past the deadline looks the same). The round counts while `min_fit_clients` report. "
        "With fedbuff: the probability that a training job never reports.",
    )
    speed_range: list[float] = option(
        [],
        "[min, max] slowdown of each client's device, drawn once per client (seeded, "
        "log-uniform). fedbuff's virtual clock: a training job takes slowdown x epochs x "
        "examples time units (1 unit: one example-epoch on the fastest device). []: all 1.",
    )

    def __post_init__(self) -> None:
        r = self.epochs_range
        if r and (len(r) != 2 or not 1 <= r[0] <= r[1]):
            raise ConfigError(
                f"heterogeneity.epochs_range = {r!r} should be [] or [min, max] "
                "with 1 <= min <= max"
            )
        speeds = self.speed_range
        if speeds and (len(speeds) != 2 or not 0 < speeds[0] <= speeds[1]):
            raise ConfigError(
                f"heterogeneity.speed_range = {speeds!r} should be [] or [min, max] "
                "with 0 < min <= max"
            )
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ConfigError(
                f"heterogeneity.dropout_rate = {self.dropout_rate} should be in [0, 1)"
            )


@dataclass
class RayConfig:
    address: str = option(
        "",
        "Ray cluster to join: 'auto' or 'HEAD_IP:6379' (from `ray start --head`). "
        "Empty: a private local Ray instance, started and stopped with the run.",
    )
    cpus_per_worker: float = option(1.0, "CPUs Ray reserves for each worker actor.")
    gpus_per_worker: float = option(
        0.0, "GPUs Ray reserves for each worker actor (with device = 'cuda')."
    )


@dataclass
class SecAggSimSettings(SecAggSettings):
    """The protocol's settings (as in server.toml) plus dropouts injected at its stages."""

    stage_dropouts: list[float] = option(
        [0.0, 0.0, 0.0, 0.0, 0.0],
        "Fraction of each round's secure-aggregation participants that vanish at each stage "
        "[setup, share_keys, masked_input, consistency, unmask] (seeded): before advertising "
        "keys, before sharing them, before the masked upload, before signing the survivor "
        "set (without the consistency check: as unmask), before revealing shares. Those gone "
        "by the masked upload are left out of the sum; the round fails (model unchanged) "
        "when too few share holders survive.",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        rates = self.stage_dropouts
        if len(rates) != len(SECAGG_STAGES) or not all(0.0 <= r < 1.0 for r in rates):
            raise ConfigError(
                f"secagg.stage_dropouts = {rates!r} should list {len(SECAGG_STAGES)} "
                f"fractions in [0, 1), one per stage {list(SECAGG_STAGES)}"
            )


@dataclass
class SimConfig:
    task: str = option(doc="Task to run, as 'package.module:ClassName'.")
    task_options: dict[str, Any] = option(
        {}, "Keyword arguments for the task's constructor.", env=True
    )
    rounds: int = option(10, "Number of federated rounds (fedbuff: model versions).")
    num_clients: int = option(10, "Number of virtual clients the training set is split into.")
    seed: int = option(0, "Seed of every stochastic choice (model init, partition, sampling).")
    backend: Literal["inline", "process", "ray"] = option(
        "inline",
        "Where clients run: `inline` (this process), `process` (a pool of worker "
        "processes on this machine) or `ray` (worker actors on a Ray cluster).",
    )
    workers: int = option(
        0,
        "Workers training clients in parallel, each folding its clients into one partial "
        "sum; 0: one per CPU core (of the cluster for `ray`). Same seed and workers: the "
        "same model bit for bit on every backend (`inline` runs the shares in turn).",
    )
    run_dir: str = option("runs/simulation", "Directory for config, metrics and models.", env=True)
    evaluate: EvaluateAt = option("auto", EVALUATE_DOC)
    eval_every: int = option(1, "Evaluate the global model every N rounds (and after the last).")
    eval_fraction: float = option(
        0.0,
        "Hold out this fraction of each client's share (seeded, never trained on) as its "
        "held-out set for federated evaluation (evaluate = auto without a test set, or "
        "sites); 0: none, unless the task's client_test_data gives one (Flower clients).",
    )
    personalize_epochs: int = option(0, PERSONALIZE_DOC)
    site_metrics: bool = option(True, SITE_METRICS_DOC)
    cross_site_validation: bool = option(False, CROSS_SITE_DOC)
    tensorboard: bool = option(False, TENSORBOARD_DOC)
    tensorboard_sites: bool = option(False, TENSORBOARD_SITES_DOC)
    tracking: TrackingConfig = section(TrackingConfig, "Experiment tracking (MLflow).")
    partition: PartitionConfig = section(PartitionConfig, "How data is split.")
    strategy: StrategyConfig = section(StrategyConfig, "The server algorithm.")
    heterogeneity: HeterogeneityConfig = section(
        HeterogeneityConfig, "Simulated device differences and dropouts."
    )
    ray: RayConfig = section(RayConfig, "The `ray` backend's cluster and resources.")
    secagg: SecAggSimSettings = section(
        SecAggSimSettings,
        "Secure aggregation (`secagg = true` or a [secagg] table): the deployment's SecAgg+ "
        "protocol run in memory each round.",
    )
    compression: CompressionSettings = section(
        CompressionSettings,
        'Update codec (`compression = "int8"` or a [compression] table): each client '
        "encodes its update, the server decodes it before folding.",
    )
    download: DownloadSettings = section(
        DownloadSettings,
        'How the global model travels to the clients (`download = "fp16"` or a table): '
        "each client trains from the model as a deployed site decodes it.",
    )
    client: dict[str, Any] = option(
        {"epochs": 1, "batch_size": 32, "lr": 0.05},
        "Round config sent to every client (epochs, batch_size, lr, momentum, ...).",
    )
    client_schedule: dict[str, Schedule] = option({}, SCHEDULE_DOC)
    device: str = option("cpu", "Device virtual clients train on ('cpu', 'cuda', 'cuda:1').")
    gpus_per_client: float = option(
        1.0,
        "With device = 'cuda' on the `process` backend: the share of a GPU each concurrent "
        "client (worker) takes; workers spread round-robin over the visible GPUs (0.25: four "
        "per GPU) and `workers = 0` means as many as fit. At most 1 (a client is one process).",
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"eval_fraction = {self.eval_fraction} must be in [0, 1)")
        if self.workers < 0:
            raise ConfigError(f"workers = {self.workers} should be >= 0 (0: one per CPU core)")
        if not 0 < self.gpus_per_client <= 1:
            raise ConfigError(
                f"gpus_per_client = {self.gpus_per_client} should be in (0, 1]: a virtual "
                "client trains in one process on one GPU (a fraction packs several on one)"
            )
        check_schedules(self.client, self.client_schedule)
        check_epochs(self.personalize_epochs, "personalize_epochs")
        self.compression.check_secagg(self.secagg.enabled)
        check_cross_site(
            self.cross_site_validation,
            False,  # local models: deployments only
            self.secagg.enabled,
        )
        if self.secagg.enabled:
            self.secagg.check_rounds(self.strategy.name, self.strategy.min_fit_clients, "clients")

    def build_strategy(self) -> Strategy:
        """The strategy `[strategy]` names, with `[client]` and `[client_schedule]`."""
        return self.strategy.build(self.client, self.client_schedule, self.rounds)
