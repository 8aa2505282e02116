"""gRPC's log: a site that hung up before its call's final status is not an error."""

from __future__ import annotations

import logging

import pytest
from grpc._cython import cygrpc

from fedtrain.runtime.server.grpc_log import GRPC_LOGGER, PeerGoneFilter, quiet_peer_gone
from tests.runtime.runtime_support import TinyTask, inprocess_server

STATUS_NOT_SENT = (
    'Failed "execute_batch": (<grpc._cython.cygrpc.SendStatusFromServerOperation object '
    "at 0x7fba52a846c0>,)"
)


def _log_error(error: BaseException) -> None:
    """As grpcio's Cython layer does: logger.exception inside the handler's except."""
    try:
        raise error
    except BaseException:
        logging.getLogger(GRPC_LOGGER).exception(
            "ExecuteBatchError raised in core by servicer method [/fedtrain.v1.Fedtrain/Control]"
        )


@pytest.fixture
def peer_gone():
    """A filter of this test's own (servers started earlier in this process installed
    one that may have counted real hang-ups)."""
    logger = logging.getLogger(GRPC_LOGGER)
    before = list(logger.filters)
    logger.filters[:] = [f for f in before if not isinstance(f, PeerGoneFilter)]
    yield quiet_peer_gone()
    logger.filters[:] = before


def test_a_status_the_site_hung_up_before_is_dropped_and_counted(peer_gone, caplog) -> None:
    with caplog.at_level(logging.ERROR, logger=GRPC_LOGGER):
        _log_error(cygrpc.ExecuteBatchError(STATUS_NOT_SENT))
    assert caplog.records == []
    assert peer_gone.dropped == 1


def test_every_other_grpc_error_still_reaches_the_log(peer_gone, caplog) -> None:
    other_op = STATUS_NOT_SENT.replace("SendStatusFromServerOperation", "SendMessageOperation")
    with caplog.at_level(logging.ERROR, logger=GRPC_LOGGER):
        _log_error(cygrpc.ExecuteBatchError(other_op))
        _log_error(RuntimeError(STATUS_NOT_SENT))
        logging.getLogger(GRPC_LOGGER).error("no exception at all")
    assert len(caplog.records) == 3
    assert peer_gone.dropped == 0


def test_a_server_installs_the_filter_once(tmp_path) -> None:
    logger = logging.getLogger(GRPC_LOGGER)
    before = list(logger.filters)
    logger.filters[:] = [f for f in before if not isinstance(f, PeerGoneFilter)]
    try:
        for run in ("a", "b"):
            server = inprocess_server(tmp_path / run, TinyTask())
            server.stop()
        assert sum(isinstance(f, PeerGoneFilter) for f in logger.filters) == 1
    finally:
        logger.filters[:] = before
