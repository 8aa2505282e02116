"""The ``[secagg]`` table of a config file, shared by the runtime and the simulation.

:class:`SecAggConfig` is the protocol's own (frozen, ``None`` for "choose for me")
configuration; this is its TOML face: every key documented with ``option()`` so the
README reference is generated from it, ``0`` standing for "automatic" (TOML has no
null), and a bad value refused when the file is read, naming the ``secagg.`` key,
instead of rounds later as a wrapped sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedtrain.config import option, section
from fedtrain.errors import ConfigError, SecAggError
from fedtrain.privacy.distributed import DistributedDPSettings
from fedtrain.secagg.config import SecAggConfig
from fedtrain.secagg.evaluation import evaluation_protocol
from fedtrain.strategy import STRATEGIES

#: `max_eval_weight` under distributed DP when it is 0 (the `max_weight` default).
DP_EVAL_WEIGHT = 100_000.0


@dataclass
class SecAggSettings:
    enabled: bool = option(
        False,
        "Mask every update so the server learns only the weighted sum over the sites "
        "(SecAgg+). Needs a sum-only strategy and >= 2 sites per round; `secagg = true` is "
        "shorthand for this table with its defaults.",
    )
    clip: float = option(
        1.0,
        "Each update value is clipped to [-clip, clip] before quantization: set it above "
        "your updates' largest values (the quantization step grows with it).",
    )
    eval_clip: float = option(
        10.0,
        "Secure evaluation: each site's mean loss and accuracy are clipped to "
        "[-eval_clip, eval_clip] before they are masked (a loss above it counts as "
        "eval_clip; the site warns). The error of the federation's mean is below "
        "sites * 2 * eval_clip * max_eval_weight / (2^bits - 1) / examples.",
    )
    bits: int = option(
        0,
        "Bits per weighted value; 0: the most that cannot wrap for max_clients "
        "(max_clients * (2^bits - 1) < 2^32).",
    )
    max_clients: int = option(
        100, "Most sites one round may aggregate; fewer leaves more bits per value."
    )
    max_weight: float = option(
        100_000.0,
        "Largest example count one site may declare. Updates are multiplied by their "
        "weight before encoding: step = 2 * clip * max_weight / (2^bits - 1).",
    )
    max_eval_weight: float = option(
        0.0,
        "Largest held-out example count one site may declare in a secure evaluation "
        "(its weight there): step = 2 * eval_clip * max_eval_weight / (2^bits - 1). "
        "0: max_weight, or 100000 under distributed DP, whose training weights are 1 "
        "(max_weight = 1 is advised there) while an evaluation's are example counts.",
    )
    weight_resolution: float = option(
        1.0, "Weights are rounded to multiples of this (1.0: example counts are exact)."
    )
    k: int = option(
        0,
        "Neighbours per site in the SecAgg+ graph; 0: sized each round from dropout_rate "
        "and corruption_rate (every other site, i.e. classic SecAgg, for small rounds).",
    )
    t: int = option(
        0,
        "Shamir threshold: shares needed to rebuild a site's secret; must exceed "
        "(k + 1) / 2. 0: with k = 0 sized with it, else the smallest secure one.",
    )
    dropout_rate: float = option(
        0.1, "Expected fraction of sites that drop mid-round; sizes k and t when they are 0."
    )
    corruption_rate: float = option(
        0.0,
        "Assumed fraction of sites colluding with the server; sizes k and t when they are 0.",
    )
    failure_probability: float = option(
        1e-6, "Target probability that dropouts make a round fail (sizing k and t)."
    )
    leak_probability: float = option(
        1e-9, "Target probability that colluders can unmask a site (sizing k and t)."
    )
    consistency_check: bool = option(
        True,
        "Sites sign the survivor set before revealing any share and refuse when fewer than "
        "t of a site's share holders signed the same set, so a server that lies about who "
        "dropped out cannot unmask one site's update. Needs site certificates (off under "
        "--insecure); adds one short stage.",
    )
    privacy: DistributedDPSettings = section(
        DistributedDPSettings,
        "Distributed DP: each site clips its update and adds discrete Gaussian noise "
        "before masking, so the unmasked sum is differentially private.",
    )

    def __post_init__(self) -> None:
        for key in ("bits", "k", "t", "max_eval_weight"):
            if getattr(self, key) < 0:
                raise ConfigError(f"secagg.{key} must be >= 0 (0: automatic)")
        try:
            protocol = self.protocol()
        except SecAggError as exc:
            raise ConfigError(f"secagg: {exc}") from None
        self.evaluation_protocol()
        if self.privacy.enabled:
            if not self.enabled:
                raise ConfigError(
                    "secagg.privacy.noise_multiplier is set but secure aggregation is off: "
                    "distributed DP needs it (secagg.enabled = true); for DP without secure "
                    'aggregation use the central `strategy.name = "dpfedavg"`'
                )
            # the model's size is known only at run time: checked again then
            self.privacy.build().check(protocol.quantizer(), length=1)

    @classmethod
    def from_scalar(cls, value: Any, key: str) -> dict[str, Any]:
        """``secagg = true`` / ``false``: the table with every default (config shorthand)."""
        if not isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r} should be true, false or a table")
        return {"enabled": value}

    def protocol(self) -> SecAggConfig:
        """The protocol configuration these settings describe (validated)."""
        return SecAggConfig(
            clip=self.clip,
            max_clients=self.max_clients,
            bits=self.bits or None,
            max_weight=self.max_weight,
            weight_resolution=self.weight_resolution,
            k=self.k or None,
            t=self.t or None,
            dropout_rate=self.dropout_rate,
            corruption_rate=self.corruption_rate,
            failure_probability=self.failure_probability,
            leak_probability=self.leak_probability,
            consistency_check=self.consistency_check,
            **(self.privacy.build().protocol_fields() if self.privacy.enabled else {}),
        )

    @property
    def eval_weight_cap(self) -> float:
        """`max_eval_weight` resolved (0: automatic, see its doc)."""
        if self.max_eval_weight:
            return self.max_eval_weight
        return DP_EVAL_WEIGHT if self.privacy.enabled else self.max_weight

    def evaluation_protocol(self) -> SecAggConfig:
        """The protocol configuration of a secure evaluation (validated)."""
        try:
            return evaluation_protocol(self.protocol(), self.eval_clip, self.eval_weight_cap)
        except SecAggError as exc:
            raise ConfigError(
                f"secagg.eval_clip = {self.eval_clip}, secagg.max_eval_weight = "
                f"{self.eval_weight_cap}: {exc}"
            ) from None

    def check_rounds(self, strategy: str, min_fit_clients: int, who: str = "sites") -> None:
        """What secure aggregation needs from the rest of a config, refused up front.

        ``strategy`` is the configured strategy name, ``min_fit_clients`` the fewest
        participants a round may have, ``who`` what the config calls them.
        """
        cls = STRATEGIES.get(strategy)
        if cls is not None:
            require_sum_only(cls)
        if min_fit_clients < 2:
            raise ConfigError(
                f"strategy.min_fit_clients = {min_fit_clients}: secure aggregation needs at "
                f"least 2 {who} per round (the sum of one is its update); raise it to 2 or more"
            )
        if min_fit_clients > self.max_clients:
            raise ConfigError(
                f"strategy.min_fit_clients = {min_fit_clients} exceeds secagg.max_clients = "
                f"{self.max_clients}: their sum could wrap; raise secagg.max_clients"
            )


def require_sum_only(strategy: Any, where: str = "strategy.name") -> None:
    """Refuse a strategy that needs more than the sum of the updates.

    Under secure aggregation the server only ever holds the sum, so a strategy that
    looks at individual updates (median, trimmed mean, Krum) or clips them on the
    server (dpfedavg) cannot run; it says so with ``needs_only_sum = False``. An
    asynchronous strategy (FedBuff) is refused too: SecAgg+ masks cancel only within
    one synchronous cohort.
    """
    name = getattr(strategy, "name", type(strategy).__name__)
    if getattr(strategy, "asynchronous", False):
        raise ConfigError(
            f"{where} = {name!r} cannot run with secure aggregation: SecAgg+ masks cancel "
            "only within a cohort of sites that agree keys and upload in one synchronous "
            f"round, while {name} folds each update on its own as it arrives, against the "
            "model version that site trained from (buffered asynchronous secure aggregation "
            "is an open research problem). Turn secure aggregation off (secagg.enabled = "
            "false) or use a synchronous strategy such as fedavg"
        )
    if getattr(strategy, "needs_only_sum", True):
        return
    raise ConfigError(
        f"{where} = {name!r} cannot run with secure aggregation: it needs every site's "
        "update (or clips them on the server), but with secagg the server only learns their "
        "sum. Use a sum-only strategy (fedavg, fedprox, fedavgm, fedadam, fedyogi, "
        "fedadagrad), or turn secure aggregation off (secagg.enabled = false)"
    )
