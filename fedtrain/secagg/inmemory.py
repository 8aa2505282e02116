"""Drive one SecAgg+ round in memory: the same state machines a deployment runs.

Used by the tests and the simulation; it is also the reference for what a transport
has to do: deliver each message, end each stage, treat silence as dropout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from fedtrain.errors import SecAggError
from fedtrain.secagg.config import SecAggConfig
from fedtrain.secagg.crypto import MaskExpander
from fedtrain.secagg.identity import InMemoryPKI
from fedtrain.secagg.messages import MaskedInput, Message, decode_message
from fedtrain.secagg.protocol import EncodedNoise, SecAggClient, SecAggResult, SecAggServer, Stage

_M = TypeVar("_M", bound=Message)
Dropouts = Mapping[int | Stage, Iterable[int]]


def _wire(msg: _M, through_bytes: bool) -> _M:
    if not through_bytes:
        return msg
    return decode_message(msg.to_bytes())  # type: ignore[return-value]


def _by_site(values: Mapping[int, Any] | Sequence[Any], name: str) -> dict[int, Any]:
    if isinstance(values, Mapping):
        return dict(values)
    return {i + 1: v for i, v in enumerate(values)}


def run_in_memory(
    vectors: Mapping[int, np.ndarray] | Sequence[np.ndarray],
    weights: Mapping[int, float] | Sequence[float],
    config: SecAggConfig,
    dropouts: Dropouts | None = None,
    *,
    round_id: int = 0,
    rng: np.random.Generator | int | None = None,
    graph_seed: bytes | None = None,
    through_bytes: bool = False,
    chunk_elements: int | None = None,
    broken_uploads: Iterable[int] = (),
    noise: EncodedNoise | None = None,
    min_included: int = 0,
    pki: InMemoryPKI | None = None,
) -> SecAggResult:
    """Run one round over ``vectors`` (site id -> update; a sequence means ids 1..n).

    Args:
        weights: per-site weight (e.g. example count), same keys as ``vectors``.
        dropouts: ``{stage: sites}``: those sites vanish at that stage (0 advertise keys,
            1 share keys, 2 masked input, 3 sign the survivor set, 4 unmask), i.e. send
            nothing from then on (without the consistency check, 3 acts as 4).
        rng: seeds the stochastic rounding (one child generator per site).
        through_bytes: send every message through ``to_bytes``/``decode_message``.
        chunk_elements: stream masked vectors to the server in chunks of this size.
        broken_uploads: sites whose masked-vector stream stops halfway (dropouts).
        noise: every site's privacy noise on its encoded update (distributed DP).
        min_included: the fewest masked inputs the server may unmask (the driver's
            acceptance minimum); fewer and the round fails with its sum still masked.
        pki: the sites' identities (each enrolled as ``site-<id>``); a fresh one when the
            config asks for the consistency check and none is given.

    Raises SecAggError when the round cannot complete (e.g. too many dropouts).
    """
    xs = _by_site(vectors, "vectors")
    ws = _by_site(weights, "weights")
    if set(xs) != set(ws):
        raise SecAggError("vectors and weights must be given for the same sites")
    lengths = {np.asarray(v).size for v in xs.values()}
    if len(lengths) != 1:
        raise SecAggError(f"all vectors must have the same size, got sizes {sorted(lengths)}")
    if config.dp_noise_multiplier > 0 and noise is None:
        raise SecAggError(
            "the config asks for distributed DP (dp_noise_multiplier > 0) but no noise was "
            "given: pass noise=DistributedDP.add_noise, with clipped updates and weight 1"
        )
    drop: dict[int, set[int]] = {int(s): set(ids) for s, ids in (dropouts or {}).items()}
    for stage in drop:
        if stage not in range(Stage.UNMASK + 1):
            raise SecAggError(f"dropout stage must be 0..{int(Stage.UNMASK)}, got {stage}")
    broken = set(broken_uploads)
    gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    site_rngs = gen.spawn(len(xs))
    expander = MaskExpander()  # shared: clients here run one after another

    if pki is None and config.consistency_check:
        pki = InMemoryPKI()
    server = SecAggServer.from_config(
        config, round_id, xs, lengths.pop(), graph_seed, min_included, verifier=pki
    )
    clients = {}
    for (site, x), site_rng in zip(sorted(xs.items()), site_rngs, strict=True):
        client = SecAggClient(
            site,
            rng=site_rng,
            expander=expander,
            noise=noise,
            identity=pki.enrol(f"site-{site}") if pki is not None else None,
            verifier=pki,
        )
        client.set_input(x, ws[site])
        clients[site] = client

    gone: set[int] = set()
    outgoing: Mapping[int, Any] = server.start()
    while True:
        stage = server.stage
        for s in range(stage + 1):  # a stage skipped (no consistency check) drops them too
            gone |= drop.get(s, set())
        for site, msg in sorted(outgoing.items()):
            if site in gone:
                continue
            reply = clients[site].handle(_wire(msg, through_bytes))
            if isinstance(reply, MaskedInput) and (chunk_elements or site in broken):
                _upload_chunks(server, reply, chunk_elements, site in broken)
                continue
            server.receive(_wire(reply, through_bytes))
        if stage == Stage.UNMASK:
            return server.finish()
        outgoing = server.advance()


def _upload_chunks(
    server: SecAggServer, msg: MaskedInput, chunk_elements: int | None, broken: bool
) -> None:
    vector = msg.vector
    n = vector.shape[0]
    step = chunk_elements or max(1, n // 4)
    stop = n // 2 if broken else n
    for start in range(0, stop, step):
        server.receive_masked_chunk(msg.site, start, vector[start : min(start + step, stop)])
    if broken:
        server.abort_masked_input(msg.site)
