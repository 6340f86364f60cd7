"""The server's listening socket: what the connections it accepts inherit."""

from __future__ import annotations

import asyncio
import socket

import pytest

from hybridserve.entrypoints.serve import bind_socket


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_accepted_connections_send_small_writes_at_once(host: str) -> None:
    """uvicorn serves a given socket through asyncio's create_server, which turns Nagle's
    algorithm off only for TCP sockets that say so; with it on, a kept-alive client waits
    out its delayed ACK (40 ms) on every request."""
    sock = bind_socket(host, 0)
    sock.listen()
    port = sock.getsockname()[1]
    nodelay: asyncio.Future[int]

    class Record(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            conn = transport.get_extra_info("socket")
            nodelay.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def accept_one() -> int:
        nonlocal nodelay
        nodelay = asyncio.get_running_loop().create_future()
        server = await asyncio.get_running_loop().create_server(Record, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                return await asyncio.wait_for(nodelay, 10)
            finally:
                writer.close()

    assert asyncio.run(accept_one()) != 0
