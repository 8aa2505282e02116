"""The Status RPC as both ends see it: the page of sites asked for, the reply's wire
form (`to_proto`/`from_proto`, side by side so a new field reaches both), and the
client (`fetch_status`) that `fedtrain status` and the benchmarks call.

The server builds the snapshot it sends in `fedtrain.runtime.server.status`.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass

import grpc

from fedtrain.errors import FedtrainError
from fedtrain.observability.status import ServerState, SiteState, TransferState
from fedtrain.runtime import rpc
from fedtrain.runtime.peer_auth import ClientIdentity, dialled_host
from fedtrain.runtime.proto import fedtrain_pb2 as pb

#: Sites a Status reply lists unless asked for more (a federation may have thousands).
DEFAULT_PAGE = 100


class ServerUnreachable(FedtrainError):
    """`fedtrain status` could not get an answer from the server."""


@dataclass(frozen=True)
class SitePage:
    """Which connected sites a snapshot lists, sorted by name: `limit` from `offset`
    (None: all of them, for Prometheus)."""

    offset: int = 0
    limit: int | None = DEFAULT_PAGE


def to_proto(state: ServerState) -> pb.StatusReply:
    return pb.StatusReply(
        run_id=state.run_id,
        task=state.task,
        phase=state.phase,
        round=state.round,
        attempt=state.attempt,
        total_rounds=state.total_rounds,
        rounds_completed=state.rounds_completed,
        min_sites=state.min_sites,
        secagg=state.secagg,
        model_version=state.model_version,
        finished=state.finished,
        sites=[
            pb.SiteStatus(
                name=s.name,
                connected_for_s=s.connected_for_s,
                last_heartbeat_age_s=s.last_heartbeat_age_s,
                down_bps=s.down_bps or 0.0,
                up_bps=s.up_bps or 0.0,
                eval_accuracy=s.eval_accuracy,
                eval_loss=s.eval_loss,
                transfers=[
                    pb.TransferStatus(
                        direction=t.direction,
                        done_bytes=t.done_bytes,
                        total_bytes=t.total_bytes,
                        bps=t.bps or 0.0,
                        idle_s=t.idle_s,
                    )
                    for t in s.transfers
                ],
            )
            for s in state.sites
        ],
        last_metrics=dict(state.last_metrics),
        connected_sites=state.connected,
        last_evaluation=dict(state.last_evaluation),
        worst_site=state.worst_site,
        bytes=dict(state.bytes),
    )


def from_proto(reply: pb.StatusReply) -> ServerState:
    return ServerState(
        run_id=reply.run_id,
        task=reply.task,
        phase=reply.phase,
        round=reply.round,
        attempt=reply.attempt,
        total_rounds=reply.total_rounds,
        rounds_completed=reply.rounds_completed,
        min_sites=reply.min_sites,
        secagg=reply.secagg,
        model_version=reply.model_version,
        finished=reply.finished,
        sites=tuple(
            SiteState(
                s.name,
                s.connected_for_s,
                s.last_heartbeat_age_s,
                s.down_bps or None,  # 0: not measured
                s.up_bps or None,
                s.eval_accuracy if s.HasField("eval_accuracy") else None,
                s.eval_loss if s.HasField("eval_loss") else None,
                tuple(
                    TransferState(t.direction, t.done_bytes, t.total_bytes, t.bps or None, t.idle_s)
                    for t in s.transfers
                ),
            )
            for s in reply.sites
        ),
        last_metrics=dict(reply.last_metrics),
        connected_sites=reply.connected_sites,
        last_evaluation=dict(reply.last_evaluation),
        worst_site=reply.worst_site,
        bytes=dict(reply.bytes),
    )


def fetch_status(
    address: str,
    identity: ClientIdentity | None,
    *,
    server_name: str = "",
    timeout_s: float = 10.0,
    page: SitePage | None = None,
) -> ServerState:
    """Ask the server at `address` for its state; `identity=None`: no TLS. With TLS the
    server challenges first and `identity` answers (`peer_auth`). The reply lists the
    sites of `page` (default: the first `DEFAULT_PAGE`)."""
    page = page or SitePage()
    paging = {"sites_offset": page.offset, "max_sites": page.limit or 0}
    options: list[tuple[str, str]] = []
    if identity is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        channel = grpc.secure_channel(address, identity.credentials, options=options)
    requests: queue.SimpleQueue[pb.StatusRequest | None] = queue.SimpleQueue()
    if identity is None:
        requests.put(pb.StatusRequest(**paging))
    with channel:
        status = channel.stream_stream(
            rpc.method_path("Status"),
            request_serializer=pb.StatusRequest.SerializeToString,
            response_deserializer=pb.StatusMessage.FromString,
        )
        call = status(iter(requests.get, None), timeout=timeout_s, wait_for_ready=False)
        answer: ServerState | None = None
        try:
            for message in call:
                if message.WhichOneof("kind") == "reply":
                    # Half-close and read the call to its end: a client that hangs up
                    # on the reply makes the server's gRPC log an ERROR with a
                    # traceback (ExecuteBatchError) for every `fedtrain status`.
                    answer = from_proto(message.reply)
                    requests.put(None)
                    continue
                if message.WhichOneof("kind") == "challenge" and identity is not None:
                    name = server_name or dialled_host(address)
                    proof = identity.proof("status", message.challenge.nonce, name)
                    requests.put(pb.StatusRequest(proof=proof, **paging))
        except grpc.RpcError as exc:
            if answer is not None:  # it answered, then the call failed: the answer stands
                return answer
            message = _unreachable(address, exc, tls=identity is not None)
            raise ServerUnreachable(message) from None
        finally:
            requests.put(None)
            call.cancel()
    if answer is not None:
        return answer
    raise ServerUnreachable(f"the server at {address} ended the Status call without an answer")


def _unreachable(address: str, exc: grpc.RpcError, *, tls: bool) -> str:
    """The error and what to check: the likely cause when the error names it, else the list."""
    what = rpc.describe_rpc_error(exc)
    if isinstance(exc, grpc.Call) and exc.code() is grpc.StatusCode.PERMISSION_DENIED:
        return f"the server at {address} refused to answer: {exc.details()}"
    details = what.lower()
    host = address.rsplit(":", 1)[0]
    if address.startswith("unix:"):
        return (
            f"no answer on the local status socket {address[5:]} ({what}): check that "
            "`fedtrain server` runs on this host with this run_dir, and that its config "
            "keeps status_socket = true"
        )
    if "connection refused" in details:
        hint = (
            f"nothing listens on {address}: check that `fedtrain server` is running there and "
            "that this is the `address` in its server.toml"
        )
    elif "hostname verification" in details:
        hint = (
            f"the server's certificate does not name {host!r}: dial a name it was issued for "
            "(`fedtrain ca issue-server --hostname`), or pass --server-name NAME"
        )
    elif not tls and "socket closed" in details:
        hint = (
            "the server closed the plain connection, so it probably runs with TLS: pass "
            "--ca/--cert/--key instead of --insecure"
        )
    else:
        checks = [
            f"that `fedtrain server` is running and listens on {address} (`address` in its "
            "server.toml; a server on 0.0.0.0 is reached by this machine's name or IP)",
            "that a firewall lets this machine reach that port",
            "that --ca is the federation's ca.crt and --cert/--key a certificate it issued "
            "(`fedtrain ca issue-site --name operator ...`; check it with `fedtrain ca check`)"
            if tls
            else "that the server runs with --insecure too (else pass --ca/--cert/--key)",
        ]
        hint = "check " + "; ".join(checks)
    return f"no answer from the server at {address} ({what}); {hint}"
