"""The floor under any Python gRPC runtime: a round's transfers with no fedtrain code at all.

A bare gRPC server process and ``sites`` client processes on 127.0.0.1. Each round
every client, all at once, downloads ``num_bytes`` (server-streaming, messages of
``chunk_bytes`` that the server sends from one prepared buffer) and then uploads as
many (client-streaming, one prepared buffer), touching none of the bytes: no
serialization, validation, folding, copies into tensors or checkpoints. A round's
time is its slowest client's. It is what a deployment round of a model of
``num_bytes`` would cost if the runtime itself were free, with the same message
limits fedtrain uses, so `runtime_vs_flower.py` reports fedtrain's round against it.

CLI::

    python -m benchmarks.grpc_floor --bytes 400e6 --sites 2 --rounds 4
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from typing import Any

import grpc

from fedtrain.tensors import DEFAULT_CHUNK_BYTES

__all__ = ["channel_options", "grpc_round_floor", "raw_handler"]


def _ident(data: bytes) -> bytes:
    return data


def channel_options(chunk_bytes: int) -> list[tuple[str, int]]:
    """Message limits for ``chunk_bytes`` messages (as fedtrain sets them)."""
    limit = chunk_bytes + (1 << 20)
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


def raw_handler(num_bytes: int, chunk_bytes: int) -> grpc.GenericRpcHandler:
    """Service ``floor``: ``Up`` counts what a client streams in; ``Down`` streams out
    ``num_bytes`` in ``chunk_bytes`` messages of one prepared buffer."""
    payload = bytes(chunk_bytes)
    messages = max(1, num_bytes // chunk_bytes)

    def upload(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        return sum(len(m) for m in requests).to_bytes(8, "little")

    def download(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        for _ in range(messages):
            yield payload

    handlers = {
        "Up": grpc.stream_unary_rpc_method_handler(
            upload, request_deserializer=_ident, response_serializer=_ident
        ),
        "Down": grpc.unary_stream_rpc_method_handler(
            download, request_deserializer=_ident, response_serializer=_ident
        ),
    }
    return grpc.method_handlers_generic_handler("floor", handlers)


def _serve(ports: Any, stop: Any, num_bytes: int, chunk_bytes: int, sites: int) -> None:
    workers = futures.ThreadPoolExecutor(max_workers=2 * sites + 2)
    server = grpc.server(workers, options=channel_options(chunk_bytes))
    server.add_generic_rpc_handlers((raw_handler(num_bytes, chunk_bytes),))
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    stop.wait()
    server.stop(0)


def _client(port: int, num_bytes: int, chunk_bytes: int, rounds: int, start: Any, out: Any) -> None:
    address = f"127.0.0.1:{port}"
    with grpc.insecure_channel(address, options=channel_options(chunk_bytes)) as channel:
        up = channel.stream_unary("/floor/Up", request_serializer=_ident)
        down = channel.unary_stream("/floor/Down", request_serializer=_ident)
        payload = bytes(chunk_bytes)
        messages = max(1, num_bytes // chunk_bytes)
        seconds = []
        for _ in range(rounds):
            start.wait()  # every client begins the round together
            began = time.perf_counter()
            for _ in down(b""):
                pass
            up(iter([payload] * messages))
            seconds.append(time.perf_counter() - began)
    out.put(seconds)


def grpc_round_floor(
    num_bytes: int, sites: int, rounds: int = 4, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> list[float]:
    """Seconds of each raw round (slowest client's download + upload), over ``rounds``."""
    ctx = mp.get_context("spawn")
    ports, stop, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    start = ctx.Barrier(sites)
    server = ctx.Process(target=_serve, args=(ports, stop, num_bytes, chunk_bytes, sites))
    server.start()
    clients: list[Any] = []
    try:
        port = ports.get(timeout=60)
        clients = [
            ctx.Process(target=_client, args=(port, num_bytes, chunk_bytes, rounds, start, out))
            for _ in range(sites)
        ]
        for client in clients:
            client.start()
        per_client = [out.get(timeout=60 + rounds * num_bytes / 1e7) for _ in clients]
    finally:
        stop.set()
        for proc in (*clients, server):
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [max(times) for times in zip(*per_client, strict=True)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=float, default=400e6, help="bytes each way per site")
    parser.add_argument("--sites", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    rounds = grpc_round_floor(int(args.bytes), args.sites, args.rounds)
    print(" ".join(f"{s:.3f}" for s in rounds), f"median {statistics.median(rounds):.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
