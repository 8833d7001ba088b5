"""LMCache's push notifications: when an LMCache P/D sender (a prefill instance) has written a prompt's KV into its
receiver's buffer, it reports the request id to one address (LMCache's "proxy notification": a msgpack map
`{"type": "ProxyNotif", "req_id": ...}` sent over a ZMQ PUSH socket to `pd_proxy_host:pd_proxy_port`).

Why wait for it: the receiver registers each chunk when its space is allocated, before the data has arrived, and
the sender's answer to the prefill request may come before the write has finished; a decode request sent on the
answer alone can find chunks that are not there yet. The router therefore sends the decode request only once the
push has been reported (`PushWatch`), and gives up with an error after a time the lab sets.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec
import zmq
import zmq.asyncio

NOTIFICATION_TYPE = "ProxyNotif"


class PushTimeout(RuntimeError):
    """No notification for a request within the time allowed."""


def decode_notification(frame: bytes) -> str | None:
    """The request id of one LMCache notification; None for anything else."""
    try:
        message = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return None
    if isinstance(message, dict) and message.get("type") == NOTIFICATION_TYPE and isinstance(message.get("req_id"),
                                                                                             str):
        return message["req_id"]
    return None


def encode_notification(req_id: str) -> bytes:
    """What LMCache's sender sends (for stand-ins and tests)."""
    return msgspec.msgpack.encode({"type": NOTIFICATION_TYPE, "req_id": req_id})


class PushWatch:
    """Listens for LMCache's push notifications on (host, port) and lets callers wait for one request's.

        watch = PushWatch("127.0.0.1", 7500); await watch.start()
        landed = watch.expect(req_id)            # before the prefill request is sent
        ...
        waited_s = await watch.wait(req_id, landed, timeout_s=30)
    """

    def __init__(self, host: str, port: int):
        self.address = f"tcp://{host}:{port}"
        self._context: zmq.asyncio.Context | None = None
        self._socket: Any = None
        self._reader: asyncio.Task | None = None
        self._pending: dict[str, asyncio.Future[float]] = {}

    async def start(self) -> None:
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(self.address)
        self._reader = asyncio.create_task(self._read())

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._socket is not None:
            self._socket.close(linger=0)
        if self._context is not None:
            self._context.term()
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()

    async def _read(self) -> None:
        while True:
            frame = await self._socket.recv()
            req_id = decode_notification(frame)
            future = self._pending.get(req_id) if req_id is not None else None
            if future is not None and not future.done():
                future.set_result(time.perf_counter())
            # Notifications nobody expects (a request already given up on, a warm-up's) are dropped.

    def expect(self, req_id: str) -> asyncio.Future[float]:
        """Start watching for `req_id` (before its prefill request is sent: the report may come first)."""
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = future
        return future

    async def wait(self, req_id: str, landed: asyncio.Future[float], timeout_s: float) -> float:
        """Seconds waited from now until `req_id`'s push was reported (0 if it already was); PushTimeout after
        `timeout_s`. Stops watching `req_id` either way."""
        start = time.perf_counter()
        try:
            at = await asyncio.wait_for(asyncio.shield(landed), timeout_s)
        except asyncio.TimeoutError:
            raise PushTimeout(f"no push notification for {req_id} within {timeout_s:g} s") from None
        finally:
            self.forget(req_id)
        return max(0.0, at - start)

    def forget(self, req_id: str) -> None:
        future = self._pending.pop(req_id, None)
        if future is not None and not future.done():
            future.cancel()


class PushListener:
    """PushWatch without asyncio, for one caller at a time (the launcher's warm-up, before the router runs)."""

    def __init__(self, host: str, port: int):
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(f"tcp://{host}:{port}")

    def wait_for(self, req_id: str, timeout_s: float) -> bool:
        """True once `req_id`'s push is reported, False after `timeout_s` without."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if self._socket.poll(int(left * 1000)) and decode_notification(self._socket.recv()) == req_id:
                return True
        return False

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()

    def __enter__(self) -> PushListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
