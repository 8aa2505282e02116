"""A site's side of secure aggregation: stage messages on the control stream, the
masked update on the upload stream.

The server sends a round's `SetupRequest` right after its `Instruction`, so key
agreement (stages 0 and 1: two fresh key pairs, Shamir shares for ``k`` neighbours,
cheap) is answered on the control-stream thread while the trainer thread downloads
and trains. The masked input (stage 2) needs both the trained update and the
neighbours' shares (`RoutedShares`); the trainer waits for the shares on a condition,
bounded by the round's deadline, then masks and uploads. A secure evaluation runs
the same stages; its masked input (the site's evaluation sums, a few values) goes on
the control stream instead. The survivor set to sign
(stage 3, the consistency check) and the unmask request (stage 4) are answered on the
control-stream thread again.

With TLS the site has an identity (`fedtrain.runtime.secagg_identity`: a signing key
endorsed by its certificate): it signs its keys and the survivor set, checks its
neighbours' signatures, and by default (`require_consistency_check`) takes part only
in rounds that run the consistency check.

Each secure instruction gets its own round here (`expect`, called in the order the
control stream delivers messages), so a retried attempt of the same round supersedes
the old one cleanly: a trainer still working for the old attempt stops without
reporting an error that the server would charge to the new one.

The update is flattened to float32 (`fedtrain.secagg.updates.UpdateLayout`: integer
buffers stay home) and multiplied by the example count *inside* the masked vector,
so the upload header carries neither the weight nor training metrics: the server
learns both only summed over the sites.

When the round's parameters ask for distributed DP, the site checks them, clips its
update, takes part with weight 1 and adds its share of discrete Gaussian noise to the
quantized vector before masking (`fedtrain.privacy.distributed`).
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fedtrain.errors import SecAggError
from fedtrain.privacy.distributed import SITE_WEIGHT, DistributedDP
from fedtrain.runtime import wire
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.secagg import (
    ConsistencyRequest,
    Identity,
    KeysBroadcast,
    MaskedInput,
    RoundParams,
    RoutedShares,
    SecAggClient,
    SetupRequest,
    Stage,
    UnmaskRequest,
    Verifier,
    decode_message,
)
from fedtrain.secagg.evaluation import eval_vector
from fedtrain.secagg.updates import UpdateLayout
from fedtrain.task import EvalResult, TrainResult
from fedtrain.tensors import Chunk, ModelState

log = logging.getLogger(__name__)


class RoundSuperseded(SecAggError):
    """The server moved on (a new attempt or round) or the session ended while this
    round was in flight: nothing to report, the newer instruction takes over."""


class ControlLink(Protocol):
    """What this module needs of the daemon's joined session (`site.Link`)."""

    outbox: queue.SimpleQueue[pb.SiteMessage | None]
    token: str
    chunk_bytes: int

    def report(self, server_round: int, message: str) -> None: ...


@dataclass(eq=False)
class _Round:
    instruction: pb.Instruction
    params: RoundParams | None = None
    client: SecAggClient | None = None
    dp: DistributedDP | None = None
    routed: RoutedShares | None = None
    #: Why this round cannot be masked here any more (None while it can).
    ended: str | None = None
    superseded: bool = False


class SiteSecAgg:
    """The site's secure-aggregation rounds, fed by the control-stream and trainer threads."""

    def __init__(
        self,
        *,
        identity: Identity | None = None,
        verifier: Verifier | None = None,
        require_consistency_check: bool = False,
    ) -> None:
        self._identity = identity
        self._verifier = verifier
        self._require_check = require_consistency_check
        self._cond = threading.Condition()
        self._round: _Round | None = None

    # -- control-stream thread -----------------------------------------------------------------
    def expect(self, instruction: pb.Instruction) -> None:
        """A secure instruction arrived: its stage messages follow; older rounds are over."""
        with self._cond:
            self._supersede(f"round {instruction.round} started again or moved on")
            self._round = _Round(instruction)

    def handle(self, link: ControlLink, message: pb.SecAggMessage) -> None:
        """Answer one stage message; a failure is reported to the server for the round."""
        server_round = message.round
        try:
            msg = decode_message(message.payload)
            with self._cond:
                current = self._current(server_round, type(msg).__name__)
                if isinstance(msg, SetupRequest):
                    if current.client is not None:
                        raise SecAggError(f"round {server_round}: a second SetupRequest")
                    # Stochastic rounding must be independent across sites (and attempts)
                    # for its errors to average out: seeded from the OS's CSPRNG, never
                    # from the site's configured seed, which sites often share.
                    rng = np.random.default_rng(secrets.randbits(128))
                    current.dp = DistributedDP.from_params(msg.params)
                    noise = current.dp.add_noise if current.dp is not None else None
                    current.client = SecAggClient(
                        msg.site,
                        rng=rng,
                        noise=noise,
                        identity=self._identity,
                        verifier=self._verifier,
                        require_consistency_check=self._require_check,
                    )
                    current.params = msg.params
                elif current.client is None:
                    raise SecAggError(f"round {server_round}: {type(msg).__name__} before setup")
                if isinstance(msg, RoutedShares):
                    current.routed = msg  # the trainer masks once the update is ready
                    self._cond.notify_all()
                    return
                answered = SetupRequest | KeysBroadcast | ConsistencyRequest | UnmaskRequest
                if not isinstance(msg, answered):
                    raise SecAggError(f"round {server_round}: unexpected {type(msg).__name__}")
                reply = current.client.handle(msg)
        except SecAggError as exc:
            self._fail(server_round, str(exc))
            log.error("round %d: secure aggregation failed at this site: %s", server_round, exc)
            link.report(server_round, f"secure aggregation failed at the site: {exc}")
            return
        link.outbox.put(
            pb.SiteMessage(
                secagg=pb.SecAggMessage(
                    round=server_round, stage=message.stage, payload=reply.to_bytes()
                )
            )
        )

    def close(self, reason: str) -> None:
        """The session ended or the site stops: any round in flight is over."""
        with self._cond:
            self._supersede(reason)

    # -- trainer thread ----------------------------------------------------------------------
    def masked_update(
        self,
        link: ControlLink,
        instruction: pb.Instruction,
        local: ModelState,
        global_state: ModelState,
        result: TrainResult,
    ) -> tuple[pb.UploadHeader, Callable[[], Iterator[Chunk]]]:
        """The upload of this round's masked update: header and its chunks (a function
        that makes them, again for each resumed stream).

        Waits (bounded by the round's deadline) for the neighbours' shares. Raises
        `RoundSuperseded` if the server moved on meanwhile, `SecAggError` if the round
        cannot be completed here.
        """
        layout = UpdateLayout.of(global_state.specs)
        vector = layout.flatten_delta(local, global_state)
        masked = self._mask(instruction, vector, float(result.num_examples))
        header = pb.UploadHeader(
            round=instruction.round,
            session_token=link.token,
            model_version=instruction.model_version,
            masked=True,
        )
        chunk_bytes = link.chunk_bytes
        return header, lambda: wire.masked_chunks(masked.vector, chunk_bytes)

    def send_masked_evaluation(
        self, link: ControlLink, instruction: pb.Instruction, result: EvalResult
    ) -> None:
        """Answer a secure EVALUATE: this site's evaluation masked (`fedtrain.secagg.
        evaluation`), sent on the control stream (a few values). Waits for the
        neighbours' shares like `masked_update`, and raises as it does."""
        vector, weight = eval_vector(result)
        masked = self._mask(instruction, vector, weight)
        link.outbox.put(
            pb.SiteMessage(
                secagg=pb.SecAggMessage(
                    round=instruction.round,
                    stage=int(Stage.MASKED_INPUT),
                    payload=masked.to_bytes(),
                )
            )
        )

    def _mask(self, instruction: pb.Instruction, vector: np.ndarray, weight: float) -> MaskedInput:
        """`vector` with `weight`, masked once the neighbours' shares are in (under
        distributed DP, which evaluations never run, clipped and noised with weight 1)."""
        with self._cond:
            current = self._await_shares(instruction)
            assert current.client is not None and current.params is not None
            assert current.routed is not None
            if current.dp is not None:  # clip to the sensitivity; the weight is public
                vector, weight = current.dp.clip(vector), SITE_WEIGHT
            _warn_clipped(instruction.round, vector, current.params.clip)
            try:
                current.client.set_input(vector, weight)
                masked = current.client.handle(current.routed)
            except SecAggError as exc:
                current.ended = str(exc)
                raise
            assert isinstance(masked, MaskedInput)
            return masked

    def _await_shares(self, instruction: pb.Instruction) -> _Round:
        """The round of `instruction` once its RoutedShares arrived (lock held)."""
        server_round = instruction.round
        while True:
            current = self._round
            if current is None or current.instruction is not instruction or current.superseded:
                raise RoundSuperseded(f"round {server_round}: the server moved on")
            if current.ended is not None:
                raise SecAggError(f"round {server_round}: {current.ended}")
            if current.routed is not None:
                return current
            left = instruction.deadline_unix - time.time()
            if left <= 0:
                current.ended = (
                    "the neighbours' shares for the masked-input stage did not arrive before "
                    "the round's deadline"
                )
                continue
            self._cond.wait(left)

    # -- helpers (lock held) -------------------------------------------------------------------
    def _current(self, server_round: int, what: str) -> _Round:
        current = self._round
        if current is None or current.instruction.round != server_round or current.superseded:
            raise SecAggError(
                f"round {server_round}: a {what} without a secure-aggregation instruction "
                "for that round"
            )
        if current.ended is not None:
            raise SecAggError(f"round {server_round}: {what} after the round ended here")
        return current

    def _fail(self, server_round: int, reason: str) -> None:
        with self._cond:
            current = self._round
            if current is not None and current.instruction.round == server_round:
                current.ended = current.ended or reason
                self._cond.notify_all()

    def _supersede(self, reason: str) -> None:
        current = self._round
        if current is not None and not current.superseded:
            current.superseded = True
            current.ended = current.ended or reason
            self._cond.notify_all()


def _warn_clipped(server_round: int, vector: np.ndarray, clip: float) -> None:
    """Tell the operator when secagg.clip cuts this site's update (the site alone can see it)."""
    clipped = int(np.count_nonzero(np.abs(vector) > clip))
    if clipped:
        log.warning(
            "round %d: %d of %d update values exceed secagg.clip = %g and were clipped; "
            "the server operator should raise secagg.clip",
            server_round,
            clipped,
            vector.size,
            clip,
        )
