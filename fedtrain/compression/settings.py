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


class _CodecTable:
    """What the `[compression]` and `[download]` tables share: a codec and its options."""

    codec: str
    fraction: float
    block: int
    table = ""

    @classmethod
    def from_scalar(cls, value: Any, key: str) -> dict[str, Any]:
        """``compression = "topk"``: the table with that codec and default options."""
        if not isinstance(value, str):
            raise ConfigError(f"{key} = {value!r} should be a codec name or a table")
        return {"codec": value}

    def _build(self, error_feedback: bool) -> Codec:
        options: dict[str, float | int | bool] = {}
        if self.codec == "topk":
            options = {"fraction": self.fraction, "error_feedback": error_feedback}
        elif self.codec == "int8":
            options = {"block": self.block}
        try:
            return build_codec(self.codec, **options)
        except ConfigError as exc:  # name the table the key is in
            raise ConfigError(str(exc).replace("compression.", f"{self.table}.")) from None

    @property
    def enabled(self) -> bool:
        return self.codec != "none"


@dataclass
class CompressionSettings(_CodecTable):
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
    table = "compression"

    def __post_init__(self) -> None:
        self.build()  # refuses a bad fraction or block now, naming the key

    def build(self) -> Codec:
        """A fresh codec (stateful for topk: one per site, or per simulated client)."""
        return self._build(self.error_feedback)

    def check_secagg(self, secagg_enabled: bool) -> None:
        """Refuse this codec together with secure aggregation, saying why."""
        check_secagg(self.build(), secagg_enabled)


DownloadCodecName = Literal["none", "fp16", "bf16", "int8", "topk"]


@dataclass
class DownloadSettings(_CodecTable):
    """How the server ships the global model to sites that can decode it (`[download]`).

    Offered by the server, taken per site: a site that does not announce the codec at
    join (another fedtrain version, or `download_codecs` in its site.toml) gets the
    model in its own dtypes, as before. See `fedtrain.compression.downlink`.
    """

    codec: DownloadCodecName = option(
        "none",
        "How the global model travels to the sites: `none` (its own dtypes, exact), "
        "`fp16`/`bf16` (floating tensors cast: half the bytes of float32; the sites train "
        "from the cast model). With `delta = true` the codec encodes the change since the "
        "version the site holds instead, and may also be `int8` or `topk`. "
        '`download = "fp16"` is shorthand for this key alone.',
    )
    delta: bool = option(
        False,
        "Send the change since the version the site holds, encoded with `codec`, instead of "
        "the model. The server keeps the model the sites hold (one copy) and folds what a "
        "codec dropped into the next change, so the sites' model trails the server's by "
        "one encoding's error and never drifts; it is bit-identical at every site (checked "
        "by digest). A site that holds another version gets the model whole, exact.",
    )
    fraction: float = option(
        0.01, "topk (delta only): fraction of each tensor's change sent, the largest first."
    )
    block: int = option(4096, "int8 (delta only): elements per block sharing one min/scale.")
    table = "download"

    def __post_init__(self) -> None:
        if self.codec in ("int8", "topk") and not self.delta:
            raise ConfigError(
                f"download.codec = {self.codec!r} needs download.delta = true: {self.codec} "
                "of the whole model would lose the model itself, while of the change "
                "what it drops is sent in a later round; set delta = true, or use fp16/bf16"
            )
        if self.delta and self.codec == "none":
            raise ConfigError(
                "download.delta = true needs a codec to encode the change with (fp16, bf16, "
                'int8 or topk): the float32 change is no smaller than the model; set codec = "int8"'
            )
        self.build()  # refuses a bad fraction or block now, naming the key

    def build(self) -> Codec:
        """The codec that encodes what travels (stateless: the server's reference
        model, not the codec, keeps what top-k left out)."""
        return self._build(error_feedback=False)
