"""The ``[compression]`` table of a config file, shared by the simulation and the runtime.

One dataclass so that a codec tried in `sim.toml` is configured the same way in
`server.toml`. Every key is documented with ``option()`` (the README's reference is
generated from it) and a bad value is refused when the file is read, naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fedtrain.compression import Codec, build_codec, check_secagg
from fedtrain.config import option
from fedtrain.errors import ConfigError

CodecName = Literal["none", "fp16", "bf16", "int8", "topk"]


@dataclass
class CompressionSettings:
    codec: CodecName = option(
        "none",
        "How each client encodes its update (the delta from the global model) for upload: "
        "`fp16`/`bf16` (cast, 2x smaller), `int8` (per-block linear quantization, ~4x), "
        "`topk` (largest entries + indices, with error feedback). Not with secure "
        'aggregation. `compression = "topk"` is shorthand for this key alone.',
    )
    fraction: float = option(
        0.01, "topk: fraction of each tensor's entries sent (the largest in magnitude)."
    )
    error_feedback: bool = option(
        True,
        "topk: each client keeps what it did not send and adds it to its next update, so "
        "nothing is lost, only delayed (Stich et al. 2018).",
    )
    block: int = option(4096, "int8: elements per block sharing one min/scale pair.")

    def __post_init__(self) -> None:
        self.build()  # refuses a bad fraction or block now, naming the key

    @classmethod
    def from_scalar(cls, value: Any, key: str) -> dict[str, Any]:
        """``compression = "topk"``: the table with that codec and default options."""
        if not isinstance(value, str):
            raise ConfigError(f"{key} = {value!r} should be a codec name or a table")
        return {"codec": value}

    def build(self) -> Codec:
        """A fresh codec (stateful for topk: one per site, or per simulated client)."""
        options: dict[str, float | int | bool] = {}
        if self.codec == "topk":
            options = {"fraction": self.fraction, "error_feedback": self.error_feedback}
        elif self.codec == "int8":
            options = {"block": self.block}
        return build_codec(self.codec, **options)

    @property
    def enabled(self) -> bool:
        return self.codec != "none"

    def check_secagg(self, secagg_enabled: bool) -> None:
        """Refuse this codec together with secure aggregation, saying why."""
        check_secagg(self.build(), secagg_enabled)
