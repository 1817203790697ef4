"""An S3 outage on demand: a TCP proxy in front of the suite's SeaweedFS server that refuses connections
and cuts the open ones while it is down. Point a process at `proxy.endpoint` instead of the server's.

`down_when(marker, seconds)` takes it down as soon as a request carrying `marker` passes (a checkpoint
file's name: the outage starts as that upload begins, at a known step), for `seconds` or until `up()`.
The bytes are plain HTTP to a loopback server, so a key's name shows in the request line.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator

BUFFER = 1 << 16


class OutageProxy:
    def __init__(self, target_endpoint: str):
        target = urllib.parse.urlparse(target_endpoint)
        self.target = (target.hostname or "127.0.0.1", int(target.port or 80))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.lock = threading.Lock()
        self.is_down = False
        self.live: set[socket.socket] = set()
        self.marker: bytes | None = None
        self.down_for: float | None = None
        self.outages: list[tuple[float, float | None]] = []  # (start, end) in time.time()
        self.refused = 0
        self.closed = False
        threading.Thread(target=self._accept, daemon=True, name="outage-proxy").start()

    # ------------------------------------------------------------------------------------------ control
    def down(self, seconds: float | None = None) -> None:
        with self.lock:
            if self.is_down:
                return
            self.is_down = True
            self.outages.append((time.time(), None))
            for sock in list(self.live):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        if seconds is not None:
            threading.Timer(seconds, self.up).start()

    def up(self) -> None:
        with self.lock:
            if self.is_down:
                self.is_down = False
                self.outages[-1] = (self.outages[-1][0], time.time())

    def down_when(self, marker: str, seconds: float | None = None) -> None:
        """Go down once a request naming `marker` passes (for `seconds`, or until `up()`)."""
        with self.lock:
            self.marker, self.down_for = marker.encode(), seconds

    def close(self) -> None:
        self.closed = True
        self.up()
        self.listener.close()
        with self.lock:
            for sock in list(self.live):
                with contextlib.suppress(OSError):
                    sock.close()

    # ------------------------------------------------------------------------------------------ pumping
    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.is_down:
                self.refused += 1
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                client.close()  # a reset, as a server that is gone
                continue
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.live |= {client, server}
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, requests: bool) -> None:
        try:
            while True:
                data = source.recv(BUFFER)
                if not data or self.is_down:
                    break
                if requests and self.marker is not None and self.marker in data:
                    with self.lock:
                        self.marker = None
                    self.down(self.down_for)
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    sock.close()
                with self.lock:
                    self.live.discard(sock)


@contextlib.contextmanager
def outage_proxy(target_endpoint: str) -> Iterator[OutageProxy]:
    proxy = OutageProxy(target_endpoint)
    try:
        yield proxy
    finally:
        proxy.close()
