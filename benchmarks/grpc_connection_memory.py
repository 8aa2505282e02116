"""What a bare gRPC server keeps per connection after each connection carried one
upload (no fedtrain code): the floor under the site swarm's memory figures.

    python -m benchmarks.grpc_connection_memory 2000 up    # or: down

A grpc.aio server process; 4 client processes hold N connections (one long call each),
then each connection moves one 400 KB message (64 at a time), then the server's RSS is
read, and read again after `malloc_trim` (asked through an RPC). Extra server options
as `OPTS=key=value,key=value` in the environment (integers); `PIECES=N` sends each
upload as N messages.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import sys
import time
from typing import Any

import grpc
import psutil

SIZE = 400_000
LIMITS = [("grpc.max_receive_message_length", 8 << 20), ("grpc.max_send_message_length", 8 << 20)]


def _ident(b: bytes) -> bytes:
    return b


def _options() -> list[tuple[str, Any]]:
    items = [x for x in os.environ.get("OPTS", "").split(",") if x]
    return [(k, int(v)) for k, v in (x.split("=", 1) for x in items)]


async def _serve(ports: Any) -> None:
    server = grpc.aio.server(options=LIMITS + _options())
    payload = b"x" * SIZE

    async def up(requests: Any, context: Any) -> bytes:
        async for _ in requests:
            pass
        return b"ok"

    async def down(request: bytes, context: Any) -> Any:
        yield payload

    async def trim(request: bytes, context: Any) -> bytes:
        from fedtrain.runtime.allocator import release_free_memory

        release_free_memory()
        return b""

    handlers = {
        "Up": grpc.stream_unary_rpc_method_handler(up, _ident, _ident),
        "Down": grpc.unary_stream_rpc_method_handler(down, _ident, _ident),
        "Hold": grpc.stream_unary_rpc_method_handler(up, _ident, _ident),
        "Trim": grpc.unary_unary_rpc_method_handler(trim, _ident, _ident),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", handlers),))
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    await server.wait_for_termination()


def _server(ports: Any) -> None:
    asyncio.run(_serve(ports))


async def _clients(port: int, count: int, mode: str, pipe: Any) -> None:
    options = [*LIMITS, ("grpc.use_local_subchannel_pool", 1)]  # a connection each
    channels = [
        grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) for _ in range(count)
    ]

    async def forever() -> Any:
        await asyncio.sleep(10**6)
        yield b""

    holds = [c.stream_unary("/t.T/Hold", _ident, _ident)(forever()) for c in channels]
    await asyncio.sleep(3)
    pipe.send("connected")
    pipe.recv()
    payload, gate = b"y" * SIZE, asyncio.Semaphore(64)
    piece = -(-SIZE // int(os.environ.get("PIECES", "1")))  # an upload in this many messages

    async def one(channel: Any) -> None:
        async def message() -> Any:
            for start in range(0, SIZE, piece):
                yield payload[start : start + piece]

        async with gate:
            if mode == "up":
                await channel.stream_unary("/t.T/Up", _ident, _ident)(message())
            else:
                async for _ in channel.unary_stream("/t.T/Down", _ident, _ident)(b""):
                    pass

    await asyncio.gather(*(one(c) for c in channels))
    pipe.send("moved")
    pipe.recv()
    for hold in holds:
        hold.cancel()


def _client(port: int, count: int, mode: str, pipe: Any) -> None:
    asyncio.run(_clients(port, count, mode, pipe))


def main(argv: list[str]) -> int:
    count, mode = int(argv[0]), argv[1]
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    server = ctx.Process(target=_server, args=(ports,))
    server.start()
    port = ports.get()
    proc = psutil.Process(server.pid)
    base = proc.memory_info().rss
    pipes, clients = [], []
    for _ in range(4):
        ours, theirs = ctx.Pipe()
        client = ctx.Process(target=_client, args=(port, count // 4, mode, theirs))
        client.start()
        pipes.append(ours)
        clients.append(client)
    for pipe in pipes:
        pipe.recv()
    time.sleep(2)
    connected = proc.memory_info().rss
    for pipe in pipes:
        pipe.send("go")
    for pipe in pipes:
        pipe.recv()
    time.sleep(3)
    after = proc.memory_info().rss
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        channel.unary_unary("/t.T/Trim", _ident, _ident)(b"")
    time.sleep(1)
    trimmed = proc.memory_info().rss
    mb = 1 << 20
    print(
        f"{mode} x {count} connections, options {_options()}: base {base // mb} MB, "
        f"connected {connected // mb} MB ({(connected - base) // count} B each), after "
        f"one {SIZE // 1000} KB message each {after // mb} MB "
        f"(+{(after - connected) // count} B each), after malloc_trim {trimmed // mb} MB"
    )
    for pipe in pipes:
        pipe.send("bye")
    for client in clients:
        client.join(10)
    server.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
