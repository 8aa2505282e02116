"""gRPC names and errors of the Fedtrain service, without the tensor machinery.

Kept apart from `wire` (which needs torch) so that `fedtrain status`, a health check
that may run every few seconds, starts in a fraction of a second.
"""

from __future__ import annotations

from typing import NoReturn

import grpc

from fedtrain.errors import ConfigError
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


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """End a server-side call with `code` and `message` (typed: control ends here)."""
    await context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover


def add_port(
    server: grpc.aio.Server,
    address: str,
    credentials: grpc.ServerCredentials | None,
    *,
    key: str,
) -> int:
    """Have `server` listen on `address` (TLS with `credentials`, None: plaintext); the
    bound port. One that cannot be bound is a ConfigError naming the config `key`."""
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError:  # grpc's own text says only "Failed to bind"
        port = 0
    if port == 0:
        raise ConfigError(
            f"cannot listen on {key} = {address!r}: is it host:port, is the port free (not "
            "used by another process, nor by this server's other port), is the host an "
            f"address of this machine? Set {key} in server.toml to a free host:port"
        )
    return port
