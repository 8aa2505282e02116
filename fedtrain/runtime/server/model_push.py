"""Small models ride inside the instruction: no download call per site and round.

Why: with a 400 KB model and 1,000 sites a round, each site's DownloadModel call (its
request, manifest, chunk and status, a transfer slot, a trip to the CPU pool) cost the
server ~1.4 ms of CPU, a fifth of all it spent on the round, and a site a round trip
before it could train. Written into the TRAIN (or EVALUATE) message on the site's
control stream, the same bytes cost one write of a message the server sends anyway.

What a site gets is exactly what a download would send it (the manifest, then the
chunks of the encoding it is served: `downloads.SharedDownloads`), made once per model
version and encoding and shared by every site's message. Only a site that announced
`wire.INLINE_MODEL_CAPABILITY` at join gets it, only for the current global model, only
up to `transfers.inline_model_bytes`, and never for a site served changes from a
reference it may hold (`[download] delta`: what it holds decides what it needs).

Memory stays bounded like downloads: at most `max_transfers` pushes are written at a
time (a model held in gRPC's send buffers until a slow link takes it). A site that
waits longer than `WAIT_S` for its turn gets its instruction without the model and
downloads it, as every site did before; so a few stalled links cannot hold back a round.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fedtrain.runtime import wire
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.server.downloads import Run, SharedDownloads
from fedtrain.runtime.server.global_model import GlobalModel
from fedtrain.runtime.server.links import LinkEstimates
from fedtrain.runtime.server.sessions import Session

log = logging.getLogger(__name__)

#: The longest an instruction waits for a push slot before it goes without the model.
WAIT_S = 1.0

Write = Callable[[Any], Awaitable[None]]


class ModelPush:
    """Writes instructions onto control streams, with the model inside when it is small."""

    def __init__(
        self,
        downloads: SharedDownloads,
        limit_bytes: int,
        slots: int,
        largest_message: int,
        links: LinkEstimates,
        count_sent: Callable[[int], None],
        *,
        current: Callable[[], GlobalModel],
        run: Run,
    ) -> None:
        self.downloads = downloads
        self.limit_bytes = limit_bytes
        self.largest_message = largest_message  # what a site accepts
        self.links = links
        self._count_sent = count_sent
        self._current, self._run = current, run  # the global model; the CPU pool
        self._slots = asyncio.Semaphore(slots) if limit_bytes else None
        #: (version, encoded) -> (the ServerMessage bytes holding the model, empty if
        #: too large to push; its tensor bytes), for the current version only.
        self._made: dict[tuple[str, bool], tuple[bytes, int]] = {}
        #: Instructions sent with the model inside, and without it for want of a slot.
        self.pushed = 0
        self.waited_out = 0

    async def send(
        self,
        session: Session,
        message: pb.ServerMessage,
        write: Write,
    ) -> None:
        """Write `message` with `write`; an instruction of the current global model to a
        site that takes it inline carries the model when it is small enough."""
        made = await self._model_for(session, message)
        if made is None:
            await write(message)
            return
        if not await self._slot():
            self.waited_out += 1
            log.debug("site %r: no push slot in %gs; it downloads the model", session.site, WAIT_S)
            await write(message)  # the site downloads it
            return
        suffix, nbytes = made
        try:
            started = time.monotonic()
            # Protobuf merges a message field that appears twice: the instruction's own
            # fields, then the shared model pieces, parse as one Instruction.
            await write(message.SerializeToString() + suffix)
        finally:
            self._slots.release()  # type: ignore[union-attr]
        instruction = message.instruction
        self.pushed += 1
        self._count_sent(nbytes)  # tensor bytes, as downloads count them
        self.links.record(
            session.site,
            "down",
            nbytes,
            time.monotonic() - started,
            whole=True,
            training=instruction.kind == pb.TRAIN,
            transfer=(instruction.model_version, ""),
        )

    async def _model_for(
        self, session: Session, message: pb.ServerMessage
    ) -> tuple[bytes, int] | None:
        """(the model's message bytes, its tensor bytes) to put in `message`; None: send
        it as it is."""
        current = self._inline_candidate(session, message)
        if current is None:
            return None
        try:
            made = await self._model_bytes(current, self.downloads.serves(session.capabilities))
        except Exception:  # e.g. the encoding failed: its download says so to the site
            log.exception("the model could not be put inside an instruction")
            return None
        return made if made[0] else None

    async def _slot(self) -> bool:
        """Take a push slot, waiting at most WAIT_S (False: none came)."""
        assert self._slots is not None
        if not self._slots.locked():  # (no timer for the usual case: a slot is free)
            await self._slots.acquire()
            return True
        try:
            await asyncio.wait_for(self._slots.acquire(), WAIT_S)
        except TimeoutError:
            return False
        return True

    def _inline_candidate(self, session: Session, message: pb.ServerMessage) -> GlobalModel | None:
        if message.WhichOneof("kind") != "instruction" or not self.limit_bytes:
            return None
        if wire.INLINE_MODEL_CAPABILITY not in session.capabilities:
            return None
        if self.downloads.track is not None and self.downloads.serves(session.capabilities):
            return None  # served changes: what it holds decides what it downloads
        current = self._current()
        if current.version != message.instruction.model_version:
            return None  # an older version (a retried round's): it downloads that one
        if current.state.nbytes > self.limit_bytes and not self.downloads.serves(
            session.capabilities
        ):
            return None  # (an encoding may still be small enough: checked when made)
        return current

    async def _model_bytes(self, model: GlobalModel, encoded: bool) -> tuple[bytes, int]:
        """The model as `ServerMessage{instruction{model: pieces}}` bytes (made once),
        and the tensor bytes they carry."""
        key = (model.version, encoded)
        made = self._made.get(key)
        if made is not None:
            return made
        manifest, pieces = await self.downloads.prepare(
            model, encoded=encoded, current=True, held="", run=self._run
        )
        made = self._made.get(key)  # another site's push made it meanwhile
        if made is not None:
            return made
        message = b""
        if manifest.total_bytes <= self.limit_bytes:
            chunks = [
                pb.ModelPiece.FromString(
                    piece if isinstance(piece, bytes) else wire.encode_chunk_message(piece)
                )
                for piece, _ in pieces
            ]
            instruction = pb.Instruction(model=[pb.ModelPiece(manifest=manifest), *chunks])
            message = pb.ServerMessage(instruction=instruction).SerializeToString()
            if len(message) > self.largest_message:
                message = b""  # its manifest is too large for one message: download it
        if any(version != model.version for version, _ in self._made):
            self._made.clear()
        made = self._made[key] = (message, manifest.total_bytes)
        return made
