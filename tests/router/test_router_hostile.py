"""Hostile input is cheap to refuse: a huge body, a prompt far over the context, or a client trickling its body must
not freeze the router's event loop, grow its memory, or hold its in-flight slots. Real processes on loopback: a
stand-in decode instance streaming tokens, and the router."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import psutil

from tests.router_processes import MODEL, metric, router, standin, url

DECODE, ROUTER, BIG_ROUTER, SLOW_DECODE, SLOW_ROUTER = 18201, 18202, 18203, 18204, 18205
MiB = 2**20


class StreamWatch(threading.Thread):
    """A streaming request running beside the hostile ones, recording when each chunk arrives."""

    def __init__(self, base: str, tokens: int):
        super().__init__(daemon=True)
        self.base, self.tokens, self.arrivals, self.error = base, tokens, [], None

    def run(self) -> None:
        body = {"model": MODEL, "prompt": "keep streaming", "max_tokens": self.tokens, "stream": True}
        try:
            with httpx.stream("POST", self.base + "/v1/completions", json=body, timeout=30) as response:
                for _ in response.iter_raw():
                    self.arrivals.append(time.monotonic())
        except httpx.HTTPError as error:  # pragma: no cover (reported by the test)
            self.error = error

    def longest_gap(self) -> float:
        return max(b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False))


def router_process(port: int) -> psutil.Process:
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "pdlab.router" in cmdline and f"--port {port}" in cmdline:
            return proc
    raise AssertionError(f"no router on port {port}")


def rss(port: int) -> int:
    return router_process(port).memory_info().rss


#: What a new worker thread may add to a router's resident memory: its stack and its allocator arena (~12 MiB here).
THREAD_MIB = 16


def hostile(base: str, content: bytes | object, timeout: float = 10) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = httpx.post(base + "/v1/completions", content=content, timeout=timeout,
                          headers={"content-type": "application/json"})
    return response, time.monotonic() - started


def test_huge_bodies_and_prompts_get_a_4xx_fast_while_streams_flow(tmp_path, model_dir):
    """A 20 MB prompt: 413 from the body limit (declared or chunked), before the body is read; with the limit
    raised, 400 from the character pre-check without tokenizing; a prompt just inside that bound, 400 after
    tokenizing on a worker thread. Meanwhile a running stream's longest gap stays under a second, and the router's
    memory does not keep what it was sent."""
    prompt_20mb = json.dumps({"model": MODEL, "prompt": "word " * 4_000_000}).encode()
    with standin(DECODE, tmp_path, "--token-ms", "40"), \
            router(ROUTER, tmp_path, model_dir, [], [DECODE]), \
            router(BIG_ROUTER, tmp_path, model_dir, [], [DECODE], max_body_bytes=64 * MiB):
        for base in (url(ROUTER), url(BIG_ROUTER)):  # warm up: first request paths, imports
            assert hostile(base, json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode())[0].is_success
        before = {port: rss(port) for port in (ROUTER, BIG_ROUTER)}
        watch = StreamWatch(url(ROUTER), tokens=150)  # 6 s of tokens
        big_watch = StreamWatch(url(BIG_ROUTER), tokens=150)
        watch.start()
        big_watch.start()
        time.sleep(0.5)

        declared, took = hostile(url(ROUTER), prompt_20mb)
        assert declared.status_code == 413 and took < 2, (declared.text, took)
        assert declared.json()["error"]["code"] == "body_too_large"

        def chunked():  # no Content-Length: the limit is checked as the body arrives
            for start in range(0, len(prompt_20mb), MiB):
                yield prompt_20mb[start:start + MiB]

        trickled, took = hostile(url(ROUTER), chunked())
        assert trickled.status_code == 413 and took < 2, (trickled.text, took)

        untokenized, took = hostile(url(BIG_ROUTER), prompt_20mb)
        assert untokenized.status_code == 400 and took < 2, (untokenized.text, took)
        error = untokenized.json()["error"]
        assert error["code"] == "context_length_exceeded" and "at least" in error["message"]

        # Within the character bound (8,192 tokens of the longest vocabulary entry) but over the context: it is
        # tokenized, on a worker thread.
        tokenized, took = hostile(url(ROUTER), json.dumps({"model": MODEL, "prompt": "ab " * 60_000}).encode())
        assert tokenized.status_code == 400 and took < 2, (tokenized.text, took)
        assert "at least" not in tokenized.json()["error"]["message"]

        watch.join(timeout=20)
        big_watch.join(timeout=20)
        assert watch.error is None and big_watch.error is None
        assert len(watch.arrivals) > 100 and len(big_watch.arrivals) > 100
        assert watch.longest_gap() < 1.0 and big_watch.longest_gap() < 1.0, (watch.longest_gap(),
                                                                              big_watch.longest_gap())
        # What a router keeps after all that: a worker thread pool at most, not what it was sent; and repeated, it
        # does not grow with each hostile request.
        after = {port: rss(port) for port in (ROUTER, BIG_ROUTER)}
        growth = {port: (after[port] - before[port]) / MiB for port in (ROUTER, BIG_ROUTER)}
        assert growth[ROUTER] < 64 and growth[BIG_ROUTER] < 64, growth

        def again() -> None:
            for _ in range(3):
                hostile(url(ROUTER), prompt_20mb)
                hostile(url(ROUTER), json.dumps({"model": MODEL, "prompt": "ab " * 60_000}).encode())
                hostile(url(BIG_ROUTER), prompt_20mb)

        again()  # the second tokenizing worker thread may start only now, with its allocator arena (~12 MiB here)
        settled = {port: rss(port) for port in (ROUTER, BIG_ROUTER)}
        threads = {port: router_process(port).num_threads() for port in (ROUTER, BIG_ROUTER)}
        again()
        repeated = {port: (rss(port) - settled[port]) / MiB for port in (ROUTER, BIG_ROUTER)}
        # A tokenizing worker thread the pool starts only now brings its arena; beyond that, nothing may stay.
        started = {port: max(0, router_process(port).num_threads() - threads[port]) for port in threads}
        assert all(repeated[port] < 8 + THREAD_MIB * started[port] for port in threads), (repeated, started)
        assert metric(url(ROUTER), "pdlab_router_in_flight") == 0


def trickle(port: int, stop: threading.Event) -> socket.socket:
    """A client that sends its headers, then its body a byte at a time, slowly."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{")

    def drip() -> None:
        while not stop.wait(0.3):
            try:
                sock.sendall(b" ")
            except OSError:
                return

    threading.Thread(target=drip, daemon=True).start()
    return sock


def test_slow_bodies_hold_no_slot_and_time_out(tmp_path, model_dir):
    """Eight clients trickling their bodies to a router with eight slots: everyone else is still served (a slot is
    taken once the body is in), and the tricklers get 408 once `body_timeout_s` is over."""
    stop = threading.Event()
    with standin(SLOW_DECODE, tmp_path), \
            router(SLOW_ROUTER, tmp_path, model_dir, [], [SLOW_DECODE], max_in_flight=8, body_timeout_s=2):
        socks = [trickle(SLOW_ROUTER, stop) for _ in range(8)]
        try:
            time.sleep(0.5)
            for _ in range(3):
                response = httpx.post(url(SLOW_ROUTER) + "/v1/completions", timeout=5,
                                      json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
                assert response.status_code == 200, response.text
            time.sleep(2.5)
            for sock in socks:
                sock.settimeout(3)
                head = sock.recv(4096)
                assert head.startswith(b"HTTP/1.1 408"), head[:200]
                assert b'"body_timeout"' in head or b"body_timeout" in sock.recv(4096)
        finally:
            stop.set()
            for sock in socks:
                sock.close()
        assert metric(url(SLOW_ROUTER), "pdlab_router_rejected_total", reason="bad_body") == 8
