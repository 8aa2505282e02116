"""gRPC's log, without one traceback per site that hung up before its call's status.

When a handler returns, grpc.aio sends the call's final status; if the site has already
cancelled the call (a daemon or a swarm site that read the run's Shutdown and closed its
channel, a `fedtrain status` from an older client, a site killed at that moment), the send
fails and grpcio logs an ERROR with a traceback (`ExecuteBatchError` for a
`SendStatusFromServerOperation`) from its Cython layer. Nothing was lost: the site got
everything the handler wrote and chose to go. At a run's end with thousands of sites
that is dozens of tracebacks in the operator's log (31 in one 10,000-site run). grpcio
offers no switch for it, so this filter drops exactly those records, counting them; every
other gRPC error still reaches the log.
"""

from __future__ import annotations

import logging

#: The logger grpcio's Cython layer logs handler errors on.
GRPC_LOGGER = "grpc._cython.cygrpc"


class PeerGoneFilter(logging.Filter):
    """Drops grpcio's "the final status could not be sent" errors; `dropped` counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if (
            error is not None
            and type(error).__name__ == "ExecuteBatchError"
            and "SendStatusFromServerOperation" in str(error)
        ):
            self.dropped += 1
            return False
        return True


def quiet_peer_gone() -> PeerGoneFilter:
    """Install the filter once per process (several servers in one process share it)."""
    logger = logging.getLogger(GRPC_LOGGER)
    for existing in logger.filters:
        if isinstance(existing, PeerGoneFilter):
            return existing
    installed = PeerGoneFilter()
    logger.addFilter(installed)
    return installed
