"""The opening of a stream a peer starts: the challenge, its proof, an audited refusal.

Every listener that lets a peer in goes through here, so they check alike: the sites'
port (a site's Control stream, anyone's Status) and the status port (`status_address`,
Status only). With TLS the server challenges first and the peer answers with a proof
of holding the key of a certificate the federation CA issued (`peer_auth`); without
TLS (--insecure) the first message is taken as it comes. A refusal is audited
(throttled) with the peer's address and a one-word cause, and logged.

Each event loop has its own `PeerCheck`: its `AdmissionGate` is used without a lock,
and a flood of unanswered challenges on the status port then cannot make the sites'
joins wait (nor the reverse).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc

from fedtrain.runtime.peer_auth import (
    PeerCertificate,
    PeerRefused,
    PeerVerifier,
    Purpose,
    new_nonce,
)
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.rpc import abort
from fedtrain.runtime.server.admission import AdmissionGate, Refusal
from fedtrain.runtime.server.audit import AuditLog

log = logging.getLogger(__name__)

NO_ANSWER = Refusal("no_answer", "the peer closed the stream before it said who it is")


class PeerCheck:
    """Challenges peers and checks their proofs with `verifier` (None: no TLS), and
    audits refusals in `audit`; see the module docstring."""

    def __init__(self, verifier: PeerVerifier | None, audit: AuditLog) -> None:
        self.verifier = verifier
        self.audit = audit
        #: Streams whose peer has not answered its challenge yet.
        self.gate = AdmissionGate()

    async def opening(
        self, context: grpc.aio.ServicerContext, challenge: Callable[[pb.Challenge], Any]
    ) -> tuple[Any, bytes, None] | tuple[None, bytes, Refusal]:
        """Challenge the peer (with TLS) and read its first message, holding a slot of
        the admission gate meanwhile: (first message, nonce, None) or (None, _, why not)."""
        if self.verifier is None:
            first = await first_message(context)
            return (first, b"", None) if first is not None else (None, b"", NO_ANSWER)
        with self.gate.pending(context.peer()) as slot:
            if not slot.granted:
                return None, b"", self.busy()
            nonce = new_nonce()
            await context.write(challenge(pb.Challenge(nonce=nonce)))
            try:
                first = await asyncio.wait_for(first_message(context), self.gate.timeout_s)
            except TimeoutError:
                timeout = f"no answer to the server's challenge within {self.gate.timeout_s:g}s"
                return None, nonce, Refusal("timeout", timeout)
        if first is not None:
            return first, nonce, None
        return None, nonce, NO_ANSWER

    def check_proof(
        self, message: pb.Join | pb.StatusRequest, purpose: Purpose, nonce: bytes
    ) -> PeerCertificate | Refusal:
        """The certificate whose key answered this stream's challenge, or why not."""
        assert self.verifier is not None
        proof = message.proof if message.HasField("proof") else None
        try:
            return self.verifier.verify(proof, purpose=purpose, nonce=nonce)
        except PeerRefused as exc:
            return Refusal(exc.cause, str(exc), site=exc.site, details=exc.audit_fields())

    async def status_request(self, context: grpc.aio.ServicerContext) -> pb.StatusRequest:
        """The first message of a Status stream from a peer that may ask: with TLS any
        certificate the federation CA issued (an operator need not be on the
        allow-list: it can ask, never join). Otherwise the refusal is audited and the
        call ends with PERMISSION_DENIED."""
        peer = context.peer()
        first, nonce, refusal = await self.opening(context, lambda c: pb.StatusMessage(challenge=c))
        if refusal is None and self.verifier is not None:
            checked = self.check_proof(first, "status", nonce)  # ~2 ms: no pool queue
            refusal = checked if isinstance(checked, Refusal) else None
        if refusal is not None:
            self.refuse("status_refused", peer, refusal)
            await abort(context, grpc.StatusCode.PERMISSION_DENIED, refusal.reason)
        return first

    def busy(self) -> Refusal:
        return Refusal(
            "busy",
            "the server is busy admitting other peers (at most "
            f"{self.gate.max_pending} at a time, {self.gate.per_address} per address); the "
            "site retries on its own (if this persists, someone may be flooding the server: "
            "the operator sees it in audit.jsonl)",
        )

    def refuse(self, event: str, peer: str, refusal: Refusal) -> None:
        """Audit (throttled) and log a refused peer; the caller tells the peer."""
        if self.audit.refusal(
            event,
            peer=peer,
            cause=refusal.cause,
            site=refusal.site,
            reason=refusal.reason,
            **refusal.details,
        ):
            log.warning(
                "refused %s (%s, %s): %s",
                refusal.site or "a peer",
                peer,
                refusal.cause,
                refusal.reason,
            )


async def first_message(context: grpc.aio.ServicerContext) -> Any:
    """The first message of a request stream; None if the peer ended or cancelled it."""
    try:
        message = await context.read()
    except grpc.RpcError:
        return None
    return None if message is grpc.aio.EOF else message
