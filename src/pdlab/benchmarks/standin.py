"""A small stand-in for a vLLM OpenAI server, run as a real process on loopback, for tests and benchmarks that
need a fast or misbehaving upstream (router overhead, fallbacks, mid-stream deaths, SSE parsing).

It speaks the same wire protocol as vLLM: `/v1/completions` and `/v1/chat/completions` (streaming or not),
`/v1/models`, `/health`, `/metrics` with vLLM's metric names, and the P/D `kv_transfer_params` handshake.
Text is made of words counted as tokens (one whitespace-separated word = one token).

    python -m pdlab.benchmarks.standin --port 8201 --name decode-0 --token-ms 2 --prefill-us-per-token 50

With `--lmcache-role` it plays one side of LMCache's P/D protocol instead of NIXL's:

- `sender` (a prefill instance, kv_producer): every request must carry `kv_transfer_params.disagg_spec` with
  LMCache's four keys, or it is refused with 400 and an OpenAI error object naming the bad key. For each of its
  `--tp` ranks it "pushes" the prompt's KV over TCP to the receiver's rank-i init and alloc ports (one JSON line
  each, as LMCache's sender contacts both per rank); a push that cannot connect is a 500.
- `receiver` (a decode instance, kv_consumer): listens on its `--lmcache-init-ports` and `--lmcache-alloc-ports`
  (on `--host`), records each push, and serves a request whose prompt was pushed on every rank without prefilling
  it (`x-standin-kv: pushed`; otherwise `local`), matching by the prompt as LMCache matches by token hashes.

Like vLLM, it aborts a request whose client goes away (stream or not), counted in `standin_aborted_total`.
`PUT /standin/health {"ok": false}` makes `/health` answer 503 (a replica failing its health checks).
`GET /standin/records` lists the generation requests a stand-in got (kv_transfer_params, max_tokens, stream, how
its KV arrived) and the pushes it received, for tests to check.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from pdlab.settings import PATH_HEADER

#: Response header saying how a stand-in decode got the prompt's KV: `pushed` (LMCache sender) or `local`.
KV_HEADER = "x-standin-kv"
#: Records kept for GET /standin/records (the benchmark sends thousands of requests: keep memory bounded).
MAX_RECORDS = 1000

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf",
         "hotel", "india", "juliet", "kilo", "lima", "mike"]


def build_app(args: argparse.Namespace) -> Starlette:
    registry = CollectorRegistry()
    running = Gauge("vllm:num_requests_running", "Requests running", ["model_name"], registry=registry)
    waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", ["model_name"], registry=registry)
    served = Counter("standin_requests", "Requests served", ["kind"], registry=registry)
    aborted = Counter("standin_aborted", "Requests whose client left before the end, aborted (as vLLM aborts them)",
                      ["stream"], registry=registry)
    waiting.labels(args.model).set(0)
    state: dict[str, Any] = {"requests": 0, "healthy": True}
    records: deque[dict[str, Any]] = deque(maxlen=MAX_RECORDS)
    pushes: deque[dict[str, Any]] = deque(maxlen=MAX_RECORDS)

    def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
              ) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                            status_code=status)

    def pushed_on_every_rank(key: str) -> bool:
        """Whether a sender pushed this prompt's KV on every receiver rank, over both ports of each."""
        got = {(p["rank"], p["channel"]) for p in pushes if p["prompt_key"] == key}
        return len(got) == 2 * len(args.lmcache_init_ports)

    async def serve_push(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, channel: str,
                         rank: int, port: int) -> None:
        # One JSON line per push; the reply tells the sender it landed (LMCache's sender waits for its peer too).
        try:
            message = json.loads(await reader.readline())
            pushes.append({**message, "channel": channel, "rank": rank, "port": port})
            writer.write(b"ok\n")
            await writer.drain()
        except (ValueError, ConnectionError):
            pass
        finally:
            writer.close()

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        servers = []
        if args.lmcache_role == "receiver":
            for channel, ports in (("init", args.lmcache_init_ports), ("alloc", args.lmcache_alloc_ports)):
                for rank, port in enumerate(ports):
                    def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, channel: str = channel,
                                rank: int = rank, port: int = port) -> Any:
                        return serve_push(r, w, channel, rank, port)
                    servers.append(await asyncio.start_server(handler, args.host, port))
        try:
            yield
        finally:
            for server in servers:
                server.close()

    notifier: dict[str, Any] = {}

    async def notify(req_id: str) -> None:
        """LMCache's proxy notification (pdlab.lmcache.push): report that `req_id`'s push has landed."""
        import zmq
        import zmq.asyncio

        from pdlab.lmcache.push import encode_notification

        if "socket" not in notifier:
            notifier["socket"] = zmq.asyncio.Context.instance().socket(zmq.PUSH)
            notifier["socket"].setsockopt(zmq.LINGER, 0)
            notifier["socket"].connect(f"tcp://{args.lmcache_notify}")
        await notifier["socket"].send(encode_notification(req_id))

    async def push_kv(spec: dict[str, Any], key: str) -> str | None:
        """Send the prompt's KV to the receiver named in `spec`, rank i to its i-th ports; None or what failed."""
        for rank in range(args.tp):
            if rank >= len(spec["receiver_init_port"]):
                return f"rank {rank} has no receiver port in {spec['receiver_init_port']}"
            for channel in ("init", "alloc"):
                port = spec[f"receiver_{channel}_port"][rank]
                line = json.dumps({"req_id": spec["req_id"], "prompt_key": key, "sender": args.name}) + "\n"
                try:
                    reader, writer = await asyncio.wait_for(asyncio.open_connection(spec["receiver_host"], port), 5)
                    writer.write(line.encode())
                    await writer.drain()
                    reply = await asyncio.wait_for(reader.readline(), 5)
                    writer.close()
                except (OSError, asyncio.TimeoutError) as exc:
                    return f"pushing KV to {spec['receiver_host']}:{port} failed: {type(exc).__name__}: {exc}"
                if reply != b"ok\n":
                    return f"receiver {spec['receiver_host']}:{port} did not acknowledge the push"
        return None

    async def records_view(_: Request) -> Response:
        return JSONResponse({"requests": list(records), "pushes": list(pushes)})

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": args.model, "object": "model",
                                                          "owned_by": "pdlab-standin", "max_model_len": 8192}]})

    async def health(_: Request) -> Response:
        return PlainTextResponse("") if state["healthy"] else PlainTextResponse("unhealthy", status_code=503)

    async def set_health(request: Request) -> Response:
        state["healthy"] = bool((await request.json()).get("ok", True))
        return JSONResponse({"ok": state["healthy"]})

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    async def generate(request: Request) -> Response:
        chat = request.url.path.endswith("/chat/completions")
        try:
            body = await request.json()
        except ValueError:
            return error(400, "malformed JSON body")
        state["requests"] += 1
        prompt = json.dumps(body.get("messages")) if chat else str(body.get("prompt", ""))
        raw = body.get("prompt")
        token_ids = isinstance(raw, list) and all(isinstance(t, int) for t in raw)  # a prompt given as token ids
        prompt_tokens = max(1, len(raw) if token_ids else len(prompt.split()))
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        kv_in = body.get("kv_transfer_params") or {}
        request_id = request.headers.get("x-request-id") or f"standin-{uuid.uuid4().hex[:12]}"
        key = hashlib.sha256(prompt.encode()).hexdigest()[:16]
        record = {"request_id": request_id, "path": request.url.path, "kv_transfer_params": body.get(
            "kv_transfer_params"), "max_tokens": body.get("max_tokens"), "stream": body.get("stream"),
            "prompt_key": key, "kv": "local"}
        records.append(record)
        if args.fail_every and state["requests"] % args.fail_every == 0:
            return error(500, "injected failure", "internal_server_error")
        remote_prefilled = bool(kv_in.get("remote_engine_id"))
        kv_out = None
        if args.lmcache_role == "sender":
            # LMCache's adapter reads these four keys of disagg_spec (a missing one is a KeyError inside vLLM);
            # refusing loudly here is what lets the router tests fail when the router gets the protocol wrong.
            if (problem := disagg_spec_problem(body.get("kv_transfer_params"))) is not None:
                where, why = problem
                return error(400, f"{where}: {why}", param=where)
            if (failure := await push_kv(kv_in["disagg_spec"], key)) is not None:
                return error(500, failure, "internal_server_error")
            if args.lmcache_notify:
                await notify(kv_in["disagg_spec"]["req_id"])
            record["kv"] = "sent"
        elif args.lmcache_role == "receiver" and pushed_on_every_rank(key):
            remote_prefilled = True
            record["kv"] = "pushed"
        elif kv_in.get("do_remote_decode"):
            kv_out = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": args.name,
                      "remote_block_ids": list(range(max(1, prompt_tokens // 16))), "remote_host": "127.0.0.1",
                      "remote_port": args.port, "tp_size": 1}
        served.labels("remote_prefilled" if remote_prefilled else "local").inc()
        kv_header = {KV_HEADER: record["kv"]}
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def choice_piece(i: int, text: str, finish: str | None, stream: bool) -> dict[str, Any]:
            if chat:
                key = "delta" if stream else "message"
                return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish}

        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                 "total_tokens": prompt_tokens + max_tokens}
        prefill_s = 0.0 if remote_prefilled else prompt_tokens * args.prefill_us_per_token / 1e6

        if not body.get("stream"):
            running.labels(args.model).inc()
            work = asyncio.ensure_future(asyncio.sleep(prefill_s + max(0, max_tokens - 1) * args.token_ms / 1000))
            gone = asyncio.ensure_future(_disconnected(request))
            try:
                await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                running.labels(args.model).dec()
                work.cancel()
                gone.cancel()
            if not work.done() or work.cancelled():
                aborted.labels("false").inc()  # the client left: vLLM aborts such a request (with_cancellation)
                return Response(status_code=499)
            text = " ".join(WORDS[i % len(WORDS)] for i in range(max_tokens))
            payload = {"id": request_id, "object": obj, "created": created, "model": args.model,
                       "choices": [choice_piece(0, text, "length", False)], "usage": usage,
                       "kv_transfer_params": kv_out}
            return JSONResponse(payload, headers={"x-request-id": request_id, **kv_header})

        stream_options = body.get("stream_options") or {}
        include_usage = bool(stream_options.get("include_usage"))
        running_usage = include_usage and bool(stream_options.get("continuous_usage_stats"))

        async def events():
            running.labels(args.model).inc()
            try:
                if args.blocking_prefill:
                    time.sleep(prefill_s)  # holds the event loop: every other stream stalls, like a colocated step
                else:
                    await asyncio.sleep(prefill_s)
                for i in range(max_tokens):
                    if args.die_after_tokens is not None and i >= args.die_after_tokens:
                        os._exit(3)  # a decode instance dying mid-stream
                    if i:
                        await asyncio.sleep(args.token_ms / 1000)
                    finish = "length" if i == max_tokens - 1 else None
                    chunk = {"id": request_id, "object": obj + ".chunk" if chat else obj, "created": created,
                             "model": args.model, "choices": [choice_piece(i, WORDS[i % len(WORDS)] + " ", finish,
                                                                           True)]}
                    if running_usage:  # vLLM's continuous_usage_stats: the tokens generated so far
                        chunk["usage"] = {**usage, "completion_tokens": i + 1, "total_tokens": prompt_tokens + i + 1}
                    yield f"data: {json.dumps(chunk)}\n\n"
                if include_usage:
                    yield f"data: {json.dumps({'id': request_id, 'object': obj, 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            except (asyncio.CancelledError, GeneratorExit):
                aborted.labels("true").inc()
                raise
            finally:
                running.labels(args.model).dec()

        headers = {"x-request-id": request_id, **kv_header}
        if args.path_header:
            headers[PATH_HEADER] = args.path_header
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    return Starlette(routes=[
        Route("/v1/models", models),
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/standin/records", records_view),
        Route("/standin/health", set_health, methods=["PUT"]),
        Route("/v1/completions", generate, methods=["POST"]),
        Route("/v1/chat/completions", generate, methods=["POST"]),
    ], lifespan=lifespan)


async def _disconnected(request: Request) -> None:
    """Return when the client of `request` (whose body was read) disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def disagg_spec_problem(kv_transfer_params: Any) -> tuple[str, str] | None:
    """What is wrong with an LMCache P/D request's kv_transfer_params, as (key path, why); None if well-formed."""
    if not isinstance(kv_transfer_params, dict) or not isinstance(kv_transfer_params.get("disagg_spec"), dict):
        return "kv_transfer_params.disagg_spec", "an LMCache sender needs the decode receiver in a disagg_spec object"
    spec = kv_transfer_params["disagg_spec"]
    where = "kv_transfer_params.disagg_spec."
    for key in ("req_id", "receiver_host"):
        if not isinstance(spec.get(key), str) or not spec[key]:
            return where + key, "a non-empty string is required"
    for key in ("receiver_init_port", "receiver_alloc_port"):
        ports = spec.get(key)
        if not isinstance(ports, list) or not ports or not all(
                isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports):
            return where + key, "a non-empty list of ports, one per GPU rank, is required"
    if len(spec["receiver_init_port"]) != len(spec["receiver_alloc_port"]):
        return where + "receiver_alloc_port", "needs as many ports as receiver_init_port"
    return None


def _ports(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="standin", help="engine id reported in kv_transfer_params")
    parser.add_argument("--model", default="pdlab-standin")
    parser.add_argument("--token-ms", type=float, default=0.0, help="delay between streamed tokens")
    parser.add_argument("--prefill-us-per-token", type=float, default=0.0,
                        help="prefill time per prompt token (skipped when the KV arrives from a prefill instance)")
    parser.add_argument("--die-after-tokens", type=int, default=None,
                        help="exit the process after streaming this many tokens (simulates a crash)")
    parser.add_argument("--fail-every", type=int, default=0, help="answer every Nth request with HTTP 500")
    parser.add_argument("--keep-alive-s", type=float, default=5.0,
                        help="close a connection idle this long after a response (uvicorn's and vLLM's default: 5)")
    # uvloop (what uvicorn picks, and what vLLM runs on) hands requests that reached a busy server together to the
    # app last-first now and then (tied bursts under CPU contention: 5 of 75 reversed, 0 of 60 on asyncio's loop);
    # a test that checks the order requests arrive in asks for asyncio's.
    parser.add_argument("--event-loop", choices=["auto", "asyncio", "uvloop"], default="auto",
                        help="the server's event loop (auto: uvloop when installed, as vLLM)")
    parser.add_argument("--blocking-prefill", action="store_true",
                        help="do the prefill delay blocking the whole server, so every running stream stalls "
                             "meanwhile (head-of-line blocking as in a colocated engine)")
    parser.add_argument("--path-header", default=None,
                        help="answer streams with this x-pdlab-path header, as pdlab's router does")
    parser.add_argument("--lmcache-role", choices=["sender", "receiver"], default=None,
                        help="play LMCache's P/D protocol: `sender` (prefill: needs a disagg_spec, pushes KV) or "
                             "`receiver` (decode: takes pushes on its LMCache ports)")
    parser.add_argument("--tp", type=int, default=1, help="sender: GPU ranks that each push to their receiver port")
    parser.add_argument("--lmcache-notify", default=None, metavar="HOST:PORT",
                        help="sender: report each push there once it landed (LMCache's pd_proxy_host/port)")
    parser.add_argument("--lmcache-init-ports", type=_ports, default=[],
                        help="receiver: pd_peer_init_port list, comma-separated")
    parser.add_argument("--lmcache-alloc-ports", type=_ports, default=[],
                        help="receiver: pd_peer_alloc_port list, comma-separated")
    args = parser.parse_args(argv)
    if args.lmcache_role == "receiver" and (not args.lmcache_init_ports
                                            or len(args.lmcache_init_ports) != len(args.lmcache_alloc_ports)):
        parser.error("a receiver needs --lmcache-init-ports and --lmcache-alloc-ports of equal length")
    return args


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)
    uvicorn.run(build_app(args), host=args.host, port=args.port, log_level="warning", access_log=False,
                timeout_keep_alive=args.keep_alive_s, loop=args.event_loop)


if __name__ == "__main__":
    main()
