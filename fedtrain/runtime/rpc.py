"""gRPC names and errors of the Fedtrain service, without the tensor machinery.

Kept apart from `wire` (which needs torch) so that `fedtrain status`, a health check
that may run every few seconds, starts in a fraction of a second.
"""

from __future__ import annotations

import grpc

from fedtrain.runtime.proto import fedtrain_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["Fedtrain"].full_name


def method_path(name: str) -> str:
    """The gRPC path of one of the Fedtrain service's methods."""
    return f"/{SERVICE}/{name}"


def describe_rpc_error(exc: grpc.RpcError) -> str:
    """A failed RPC as one line, with a hint when it looks like a TLS problem."""
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    text = f"{code.name if code else 'error'}: {details}"
    if code is grpc.StatusCode.UNAVAILABLE and "handshake" in (details or "").lower():
        text += (
            " (the TLS handshake failed: check that this machine's certificate was issued by "
            "the federation CA the server trusts, and that tls.ca is that CA)"
        )
    return text
