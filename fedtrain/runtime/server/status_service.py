"""The Status RPC, wherever it is answered: the sites' port, the status port
(`status_address`) and the run directory's socket.

One handler for all three, so that they cannot drift apart. With a `PeerCheck` the
caller is challenged and checked as on the sites' port, and a refusal is audited;
without one (the socket) the file system already decided who may ask. `health` says
why the server cannot serve its sites (then the call fails with UNAVAILABLE, and so
does a liveness probe); it matters only off the main event loop, which cannot answer
while it hangs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator

import grpc

from fedtrain.observability.status import ServerState
from fedtrain.runtime import status
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.rpc import abort
from fedtrain.runtime.server.peer_check import PeerCheck, first_message

#: The run's state for one page of its sites; safe to call from any thread.
Snapshot = Callable[[status.SitePage], ServerState]
#: Why the server cannot serve its sites now, or None.
Health = Callable[[], str | None]


def _healthy() -> str | None:
    return None


class StatusService:
    """Answers Status with `snapshot`; see the module docstring."""

    def __init__(
        self, snapshot: Snapshot, *, peers: PeerCheck | None, health: Health = _healthy
    ) -> None:
        self._snapshot, self._peers, self._health = snapshot, peers, health

    async def Status(
        self, request_iterator: AsyncIterator[pb.StatusRequest], context: grpc.aio.ServicerContext
    ) -> None:
        if self._peers is not None:
            first = await self._peers.status_request(context)
        else:
            first = await first_message(context)
            if first is None:
                return
        answer = self.answer(first)
        if isinstance(answer, str):
            await abort(context, grpc.StatusCode.UNAVAILABLE, answer)
        await context.write(answer)

    def answer(self, first: pb.StatusRequest) -> pb.StatusMessage | str:
        """The reply to `first`, or why the server cannot serve its sites now (the call
        then fails with UNAVAILABLE). Answered where it is asked, not on the pool: a
        snapshot takes no round lock (milliseconds even with 10,000 sites), and behind a
        round's queued chunk work it would wait seconds."""
        unhealthy = self._health()
        if unhealthy is not None:
            return unhealthy
        page = status.SitePage(first.sites_offset, first.max_sites or status.DEFAULT_PAGE)
        return pb.StatusMessage(reply=status.to_proto(self._snapshot(page)))

    def serve_blocking(
        self, requests: Iterator[pb.StatusRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.StatusMessage]:
        """Status on grpc's synchronous server, for a caller the file system already
        checked (the run dir's socket: no `PeerCheck`, whose challenges need a loop)."""
        assert self._peers is None, "a peer check needs the asyncio handler"
        try:
            first = next(requests)
        except (StopIteration, grpc.RpcError):  # the caller ended or cancelled the call
            return
        answer = self.answer(first)
        if isinstance(answer, str):
            context.abort(grpc.StatusCode.UNAVAILABLE, answer)
        yield answer

    def method(self, *, blocking: bool = False) -> grpc.RpcMethodHandler:
        """The Status method's handler, for a grpc.aio server's generic handler (or, with
        `blocking`, a synchronous server's)."""
        return grpc.stream_stream_rpc_method_handler(
            self.serve_blocking if blocking else self.Status,
            request_deserializer=pb.StatusRequest.FromString,
            response_serializer=pb.StatusMessage.SerializeToString,
        )
