"""The router's HTTP/1.1 client for its generation calls to the instances: kept-alive connections per instance,
answers parsed by httptools (llhttp, the parser uvicorn serves the router with), bodies handed on as they arrive.

Why not aiohttp here (it still makes the health checks and metric scrapes): the generation calls are the router's
largest cost, two per P/D request. Profiled in `pdlab bench router --profile`, aiohttp's client took 0.65 ms per
request (data/results/router-profile/20261205-165359.json) and this one takes 0.13 ms
(data/results/router-profile/20261206-064021.json); docs/router.md, "Where the time went". aiohttp makes request and
response objects, timers and a stream reader for every call. What the router needs is less: POST a body it has
already encoded, read the status and headers, then the body at once or chunk by chunk; drop the connection when the
caller goes away (so the instance aborts the request); reuse it otherwise.

Semantics the router relies on:
- `ConnectFailed`: no connection could be made (nothing was sent): safe to try another instance.
- `UpstreamDisconnected`: the connection closed before the answer ended; `TimeoutError`: the instance was silent
  for `read_timeout_s` while an answer was awaited (the connection is dropped).
- A kept-alive connection the instance closed while idle is noticed before use, and a request whose reused
  connection closes before any byte of the answer is sent again once on a new connection (the instance never read
  it: it closes idle connections only).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from typing import NamedTuple
from urllib.parse import urlsplit

import httptools

#: Answer bytes buffered unread before the connection stops reading (the instance is then held back by TCP).
READ_BUFFER_BYTES = 1 << 20


class UpstreamError(Exception):
    """An upstream call failed (not a timeout: those are `TimeoutError`)."""


class ConnectFailed(UpstreamError):
    """No connection could be opened; nothing was sent."""


class UpstreamDisconnected(UpstreamError):
    """The connection closed (or sent something that is not HTTP) before the answer ended."""


class Target(NamedTuple):
    """Where a call goes: parsed once per instance and path."""

    host: str
    port: int
    tls: bool
    head: bytes
    """The request line and Host header."""

    @property
    def key(self) -> tuple[str, int, bool]:
        return self.host, self.port, self.tls


def target(url: str) -> Target:
    """`http://host:port/path` (or https) as a `Target`."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return Target(parts.hostname, port, tls, f"POST {path} HTTP/1.1\r\nhost: {parts.netloc}\r\n".encode("latin-1"))


class Response:
    """An answer being read: status and headers are in; the body arrives as `readany()` / `read()` are awaited."""

    __slots__ = ("status", "_raw_headers", "_headers", "_conn", "_chunks", "_size", "_eof", "_error", "_waiter",
                 "_done")

    def __init__(self, conn: _Connection, status: int, raw_headers: list[tuple[bytes, bytes]]):
        self.status = status
        self._raw_headers = raw_headers
        self._headers: dict[str, str] | None = None
        self._conn = conn
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._done = False

    @property
    def headers(self) -> dict[str, str]:
        """The answer's headers, names in lower case (decoded when first asked for)."""
        if self._headers is None:
            self._headers = {name.decode("latin-1").lower(): value.decode("latin-1")
                             for name, value in self._raw_headers}
        return self._headers

    # called by the connection
    def _feed(self, data: bytes) -> None:
        if self._done:  # released before its end: dropped
            return
        self._chunks.append(data)
        self._size += len(data)
        if self._size > READ_BUFFER_BYTES:
            self._conn.pause()
        self._wake()

    def _end(self, error: BaseException | None = None) -> None:
        if error is None:
            self._eof = True
        elif not self._eof:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # for the caller
    def at_eof(self) -> bool:
        """The whole answer has been read."""
        return self._eof and not self._chunks

    async def readany(self) -> bytes:
        """What has arrived since the last read (waiting for something if nothing has); b"" at the end."""
        while True:
            if self._chunks:
                data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
                self._chunks.clear()
                if self._size > READ_BUFFER_BYTES:
                    self._conn.resume()
                self._size = 0
                return data
            if self._error is not None:
                raise self._error
            if self._eof:
                return b""
            self._waiter = self._conn.loop.create_future()
            self._conn.waiting(self._waiter)
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def read(self) -> bytes:
        """The rest of the answer."""
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)  # b"" for none

    def release(self, end_within_s: float = 0.0) -> None:
        """Done with this answer: its connection is kept for another call if the answer has ended (or, given
        `end_within_s`, if its end arrives within that time: what arrives meanwhile is dropped), else closed (an
        instance still generating for it aborts the request)."""
        if self._done:
            return
        self._done = True
        self._chunks.clear()
        if self._size > READ_BUFFER_BYTES:
            self._conn.resume()
        self._size = 0
        if self._eof or self._error is not None or not end_within_s:
            self._conn.finished(reuse=self._eof)
        else:
            self._conn.finish_later(end_within_s)

    def close(self) -> None:
        """Done with this answer, read or not: close its connection."""
        if not self._done:
            self._done = True
            self._conn.finished(reuse=False)


class _Connection(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection: one call at a time."""

    def __init__(self, client: UpstreamClient, key: tuple[str, int, bool]):
        self.client = client
        self.key = key
        self.loop = client.loop
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.keep_alive = False
        self.received = 0
        self.last_activity = 0.0
        self.idle_since = 0.0
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_waiter: asyncio.Future[Response] | None = None
        self._response: Response | None = None
        self._watched: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._finishing: asyncio.TimerHandle | None = None
        self._paused = False
        self._complete = False
        self._stray = False

    # --- asyncio.Protocol ---
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._complete or (self._head_waiter is None and self._response is None):
            self.abort()  # bytes after the answer's end, or with no call made: this connection is off
            return
        self.received += len(data)
        self.last_activity = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._fail(UpstreamDisconnected(f"the instance's answer is not HTTP: {error}"))
            self.abort()
            return
        if self._stray:
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.client._forget(self)
        for timer in (self._timer, self._finishing):
            if timer is not None:
                timer.cancel()
        self._timer = self._finishing = None
        self._fail(UpstreamDisconnected(f"the instance closed the connection ({exc or 'no error'})"))

    # --- httptools callbacks ---
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self._complete:  # a second answer to one request
            self._stray = True
            return
        status = self.parser.get_status_code()
        if status < 200:  # an interim answer (100 Continue): the real one follows
            self._headers = []
            return
        self._response = Response(self, status, self._headers)
        self._headers = []
        waiter, self._head_waiter = self._head_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(self._response)

    def on_body(self, body: bytes) -> None:
        if self._response is not None and not self._complete:
            self._response._feed(body)

    def on_message_complete(self) -> None:
        if self._response is None or self._complete:  # the end of an interim answer, or of a stray one
            return
        self.keep_alive = self.parser.should_keep_alive()
        self._complete = True
        self._response._end()
        if self._finishing is not None:  # released before its end, which has now come
            self._finishing.cancel()
            self._finishing = None
            self.finished(reuse=True)

    # --- for the client and the response ---
    def send(self, head: bytes, body: bytes) -> asyncio.Future[Response]:
        assert self.transport is not None
        if self.closed:
            raise UpstreamDisconnected("the connection is closed")
        self.keep_alive = False
        self._complete = False
        self.received = 0
        self._response = None
        self.last_activity = self.loop.time()
        waiter = self._head_waiter = self.loop.create_future()
        if len(body) < 65536:
            self.transport.write(head + body)  # one write for a small request
        else:
            self.transport.writelines((head, body))
        self.waiting(waiter)
        return waiter

    def waiting(self, future: asyncio.Future) -> None:
        """Someone awaits bytes from the instance: time its silence."""
        self._watched = future
        if self._timer is None:
            self._timer = self.loop.call_at(self.last_activity + self.client.read_timeout_s, self._check_silence)

    def _check_silence(self) -> None:
        self._timer = None
        watched = self._watched
        if watched is None or watched.done():
            return
        due = self.last_activity + self.client.read_timeout_s
        if self.loop.time() < due:
            self._timer = self.loop.call_at(due, self._check_silence)
            return
        self._fail(TimeoutError(f"the instance sent nothing for {self.client.read_timeout_s:g} s"))
        self.abort()

    def _fail(self, error: BaseException) -> None:
        waiter, self._head_waiter = self._head_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        if self._response is not None:
            self._response._end(error)

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def finish_later(self, within_s: float) -> None:
        """The caller is done, the answer not yet: keep the connection if its end comes within `within_s`."""
        self._watched = None
        self._finishing = self.loop.call_later(within_s, self.abort)

    def finished(self, reuse: bool) -> None:
        self._watched = None
        self._response = None
        if reuse and self.keep_alive and not self.closed and not self._paused:
            self.client._park(self)
        else:
            self.abort()

    def abort(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.abort()


class UpstreamClient:
    """Kept-alive connections to the instances, and the calls made over them. One event loop owns it."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float, keepalive_s: float):
        self.loop = asyncio.get_running_loop()
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.keepalive_s = keepalive_s
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._tls: ssl.SSLContext | None = None

    async def post(self, to: Target, body: bytes, headers: dict[str, str]) -> Response:
        """POST `body` with `headers`; returns once the answer's status and headers are in. The caller then reads
        the body and must `release()` or `close()` the answer."""
        head = to.head + b"content-length: %d\r\n" % len(body) + _encode(headers)
        conn = self._idle_connection(to.key)
        if conn is not None:
            try:
                return await self._send(conn, head, body)
            except UpstreamDisconnected:
                if conn.received:
                    raise
                # closed while we sent on it: the instance never read the request (it closes idle connections)
        return await self._send(await self._connect(to), head, body)

    @staticmethod
    async def _send(conn: _Connection, head: bytes, body: bytes) -> Response:
        try:
            return await conn.send(head, body)
        except BaseException:
            conn.abort()  # cancelled or failed before the answer: the instance must not go on with it
            raise

    def _idle_connection(self, key: tuple[str, int, bool]) -> _Connection | None:
        idle = self._idle.get(key)
        now = self.loop.time()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.abort()
        return None

    async def _connect(self, to: Target) -> _Connection:
        conn = _Connection(self, to.key)
        tls: ssl.SSLContext | None = None
        if to.tls:
            tls = self._tls = self._tls or ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await self.loop.create_connection(lambda: conn, to.host, to.port, ssl=tls)
        except TimeoutError:
            raise ConnectFailed(f"no connection to {to.host}:{to.port} within {self.connect_timeout_s:g} s") from None
        except OSError as error:
            raise ConnectFailed(f"cannot connect to {to.host}:{to.port}: {error}") from None
        self._open.add(conn)
        return conn

    def _park(self, conn: _Connection) -> None:
        conn.idle_since = self.loop.time()
        self._idle.setdefault(conn.key, []).append(conn)

    def _forget(self, conn: _Connection) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def close(self) -> None:
        """Close every connection (calls in progress fail)."""
        for conn in list(self._open):
            conn.abort()
        self._idle.clear()


def _encode(headers: dict[str, str]) -> bytes:
    lines = []
    for name, value in headers.items():
        if "\r" in value or "\n" in value:
            raise ValueError(f"header {name!r} has a line break")
        lines.append(f"{name}: {value}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1", errors="replace")
