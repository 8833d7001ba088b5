"""The router's upstream HTTP client (`pdlab.router.upstream`) against real HTTP servers on loopback sockets: kept-alive
connections, both body framings, an idle connection the server closed, silence, a caller that goes away, answers
that are not HTTP, large answers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import pytest

from pdlab.router.upstream import ConnectFailed, UpstreamClient, UpstreamDisconnected, target

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, dict], Awaitable[None]]


async def _request(reader: asyncio.StreamReader) -> bytes | None:
    """One request's body (None at the end of the connection)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    return await reader.readexactly(length)


def _run(handler: Handler, client_test: Callable[[UpstreamClient, str, dict], Awaitable[None]],
         read_timeout_s: float = 5.0) -> dict:
    """Serve `handler` on a loopback port and run `client_test` against it; returns what the server recorded."""
    seen: dict = {"connections": 0, "requests": [], "closed": 0}

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen["connections"] += 1
        try:
            await handler(reader, writer, seen)
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = UpstreamClient(connect_timeout_s=2.0, read_timeout_s=read_timeout_s, keepalive_s=300.0)
        try:
            await client_test(client, f"http://127.0.0.1:{port}/v1/completions", seen)
        finally:
            client.close()
            server.close()
            await server.wait_closed()

    asyncio.run(main())
    return seen


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: dict) -> None:
    """Answers each request with its own body: sized, then chunked, in turn; keeps the connection."""
    while (body := await _request(reader)) is not None:
        seen["requests"].append(body)
        if len(seen["requests"]) % 2:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(body), body))
        else:
            half = len(body) // 2
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (half, body[:half]))
            await writer.drain()
            await asyncio.sleep(0.01)
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body) - half, body[half:]))
        await writer.drain()


def test_connections_are_kept_alive_and_both_framings_read():
    async def calls(client: UpstreamClient, url: str, _: dict) -> None:
        for n in range(4):
            body = b'{"n": %d, "pad": "%s"}' % (n, b"x" * 1000 * n)
            response = await client.post(target(url), body, {"content-type": "application/json"})
            assert response.status == 200
            assert await response.read() == body
            response.release()

    seen = _run(_echo, calls)
    assert seen["connections"] == 1 and len(seen["requests"]) == 4


def test_an_empty_answer_and_bytes_after_an_answer():
    """An empty body reads as b""; bytes the server sends after an answer's end mean the connection is off: it is
    not used again."""
    async def extra(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: dict) -> None:
        while (body := await _request(reader)) is not None:
            seen["requests"].append(body)
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n")
            if body == b"0":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstray")
            await writer.drain()

    async def calls(client: UpstreamClient, url: str, _: dict) -> None:
        for n in range(2):
            response = await client.post(target(url), b"%d" % n, {})
            assert response.status == 500 and await response.read() == b""
            await asyncio.sleep(0.1)
            response.release()

    seen = _run(extra, calls)
    assert seen["requests"] == [b"0", b"1"] and seen["connections"] == 2


def test_streamed_chunks_arrive_as_they_are_sent():
    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: dict) -> None:
        await _request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for n in range(3):
            event = b"data: %d\n\n" % n
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def calls(client: UpstreamClient, url: str, _: dict) -> None:
        response = await client.post(target(url), b"{}", {})
        assert response.headers["content-type"] == "text/event-stream"
        got = []
        while chunk := await response.readany():
            got.append(chunk)
        assert got == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"] and response.at_eof()
        response.release()

    _run(stream, calls)


def test_an_idle_connection_the_server_closed_is_replaced_and_the_request_sent_once():
    async def one_per_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: dict) -> None:
        body = await _request(reader)
        seen["requests"].append(body)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")  # says keep-alive, then closes anyway
        await writer.drain()

    async def calls(client: UpstreamClient, url: str, _: dict) -> None:
        for n in range(3):
            response = await client.post(target(url), b"%d" % n, {})
            assert await response.read() == b"ok"
            response.release()
            if n == 1:
                continue  # the third request goes out at once, racing the server's close
            await asyncio.sleep(0.05)

    seen = _run(one_per_connection, calls)
    assert seen["requests"] == [b"0", b"1", b"2"] and seen["connections"] == 3


@pytest.mark.parametrize("end_after_s", [0.02, 0.4])
def test_an_answer_released_before_its_end_keeps_its_connection_only_if_the_end_comes_in_time(end_after_s):
    async def late_end(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: dict) -> None:
        while (body := await _request(reader)) is not None:
            seen["requests"].append(body)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\ne\r\ndata: [DONE]\n\n\r\n")
            await writer.drain()
            await asyncio.sleep(end_after_s)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async def calls(client: UpstreamClient, url: str, _: dict) -> None:
        for n in range(2):
            response = await client.post(target(url), b"%d" % n, {})
            assert await response.readany() == b"data: [DONE]\n\n"
            response.release(end_within_s=0.2)
            await asyncio.sleep(0.45)

    seen = _run(late_end, calls)
    assert seen["requests"] == [b"0", b"1"]
    assert seen["connections"] == (1 if end_after_s < 0.2 else 2)


def test_silence_times_out_and_drops_the_connection():
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: dict) -> None:
        await _request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        seen["eof"] = await reader.read() == b""  # the client closed its end

    async def calls(client: UpstreamClient, url: str, seen: dict) -> None:
        response = await client.post(target(url), b"{}", {})
        assert await response.readany() == b"hello"
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(TimeoutError):
            await response.readany()
        assert 0.25 <= loop.time() - started < 2.0
        response.release()
        await asyncio.sleep(0.1)

    seen = _run(stall, calls, read_timeout_s=0.3)
    assert seen["eof"]


def test_a_caller_that_goes_away_closes_the_connection():
    async def never_answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: dict) -> None:
        await _request(reader)
        seen["eof"] = await reader.read() == b""
        seen["closed_at"] = asyncio.get_running_loop().time()

    async def calls(client: UpstreamClient, url: str, seen: dict) -> None:
        call = asyncio.create_task(client.post(target(url), b"{}", {}))
        await asyncio.sleep(0.2)
        call.cancel()
        cancelled_at = asyncio.get_running_loop().time()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.sleep(0.2)
        assert seen.get("eof") and seen["closed_at"] - cancelled_at < 0.2

    _run(never_answers, calls)


@pytest.mark.parametrize(("answer", "fails_at", "match"), [
    (b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this", "body", "closed the connection"),
    (b"SSH-2.0-OpenSSH\r\n\r\n", "head", "not HTTP"),
], ids=["cut mid-answer", "not HTTP"])
def test_a_broken_answer_is_an_error_not_a_short_answer(answer, fails_at, match):
    async def broken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: dict) -> None:
        await _request(reader)
        writer.write(answer)
        await writer.drain()
        if fails_at == "head":
            await reader.read()  # the client must give up on its own

    async def calls(client: UpstreamClient, url: str, _: dict) -> None:
        with pytest.raises(UpstreamDisconnected, match=match):
            response = await client.post(target(url), b"{}", {})
            assert fails_at == "body"
            await response.read()

    _run(broken, calls)


def test_a_large_answer_arrives_whole_and_unread_bytes_hold_the_server_back():
    blob = bytes(range(256)) * (12 * 4096)  # 12 MiB: more than the read buffer and the sockets' buffers

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: dict) -> None:
        while await _request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(blob) + blob)
            await writer.drain()
            seen.setdefault("sent_at", []).append(asyncio.get_running_loop().time())

    async def calls(client: UpstreamClient, url: str, seen: dict) -> None:
        for n in range(2):
            response = await client.post(target(url), b"{}", {})
            await asyncio.sleep(0.3)  # not reading: the client stops reading the socket, so the server waits
            reading_at = asyncio.get_running_loop().time()
            assert await response.read() == blob
            response.release()
            assert seen["sent_at"][n] > reading_at

    seen = _run(big, calls)
    assert seen["connections"] == 1


def test_no_listener_is_a_connect_failure():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: refused

        async def main() -> None:
            client = UpstreamClient(connect_timeout_s=2.0, read_timeout_s=2.0, keepalive_s=300.0)
            with pytest.raises(ConnectFailed):
                await client.post(target(f"http://127.0.0.1:{port}/v1/completions"), b"{}", {})

        asyncio.run(main())


def test_a_header_with_a_line_break_is_refused_and_urls_are_checked():
    async def calls(client: UpstreamClient, url: str, _: dict) -> None:
        with pytest.raises(ValueError, match="line break"):
            await client.post(target(url), b"{}", {"x-request-id": "a\r\nx-evil: 1"})

    _run(_echo, calls)
    with pytest.raises(ValueError, match="not an http"):
        target("ftp://example.com/")
