"""An asyncio TCP proxy that injects store outages between the proxy and PostgreSQL, so
chaos tests never stop or freeze the real (shared) server.

    fault = FaultProxy("127.0.0.1", 5432)
    port = await fault.start()
    fault.stop_server()   # like PostgreSQL stopped: drop every connection, refuse new ones
    fault.freeze()        # like PostgreSQL frozen (SIGSTOP): connections open, no bytes
    fault.restore()       # forward again (buffered bytes flow on)
    await fault.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import socket


class FaultProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.accepted = 0

    async def start(self) -> int:
        await self._listen()
        return self.port

    async def _listen(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self._server = await asyncio.start_server(self._handle, sock=sock)
        self.port = sock.getsockname()[1]

    # -- faults ---------------------------------------------------------------------------

    def stop_server(self) -> None:
        """Refuse new connections (nothing listens on the port) and drop every open one."""
        if self._server is not None:
            self._server.close()
            self._server = None
        self.drop_connections()

    def drop_connections(self) -> None:
        for writer in list(self._writers):
            transport = writer.transport
            transport.abort()
        self._writers.clear()

    def freeze(self) -> None:
        """Stop forwarding bytes either way; connections (new ones too) stay open."""
        self._flowing.clear()

    async def restore(self) -> None:
        """Forward again, and listen again if the server was stopped."""
        self._flowing.set()
        if self._server is None:
            await self._listen()

    async def close(self) -> None:
        self._flowing.set()
        if self._server is not None:
            self._server.close()
            self._server = None
        self.drop_connections()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- forwarding -----------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self._writers.add(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            self._writers.discard(writer)
            return
        self._writers.add(up_writer)
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(source, sink, (writer, up_writer)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter,
        pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
    ) -> None:
        try:
            while True:
                await self._flowing.wait()
                chunk = await source.read(65536)
                if not chunk:
                    break
                await self._flowing.wait()  # a frozen server neither reads nor answers
                sink.write(chunk)
                await sink.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for end in pair:
                with contextlib.suppress(Exception):
                    end.transport.abort()
                self._writers.discard(end)
