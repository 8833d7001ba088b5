"""A small stand-in for a vLLM OpenAI server, run as a real process on loopback, for tests and benchmarks that
need a fast or misbehaving upstream (router overhead, fallbacks, mid-stream deaths, SSE parsing).

It speaks the same wire protocol as vLLM: `/v1/completions` and `/v1/chat/completions` (streaming or not),
`/v1/models`, `/health`, `/metrics` with vLLM's metric names, and the P/D `kv_transfer_params` handshake.
Text is made of words counted as tokens (one whitespace-separated word = one token).

    python -m pdlab.standin --port 8201 --name decode-0 --token-ms 2 --prefill-us-per-token 50
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from pdlab.settings import PATH_HEADER

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf",
         "hotel", "india", "juliet", "kilo", "lima", "mike"]


def build_app(args: argparse.Namespace) -> Starlette:
    registry = CollectorRegistry()
    running = Gauge("vllm:num_requests_running", "Requests running", ["model_name"], registry=registry)
    waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", ["model_name"], registry=registry)
    served = Counter("standin_requests", "Requests served", ["kind"], registry=registry)
    waiting.labels(args.model).set(0)
    state = {"requests": 0}

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}},
                            status_code=status)

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": args.model, "object": "model",
                                                          "owned_by": "pdlab-standin", "max_model_len": 8192}]})

    async def health(_: Request) -> Response:
        return PlainTextResponse("")

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    async def generate(request: Request) -> Response:
        chat = request.url.path.endswith("/chat/completions")
        try:
            body = await request.json()
        except ValueError:
            return error(400, "malformed JSON body")
        state["requests"] += 1
        if args.fail_every and state["requests"] % args.fail_every == 0:
            return error(500, "injected failure", "internal_server_error")
        prompt = json.dumps(body.get("messages")) if chat else str(body.get("prompt", ""))
        prompt_tokens = max(1, len(prompt.split()))
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        kv_in = body.get("kv_transfer_params") or {}
        remote_prefilled = bool(kv_in.get("remote_engine_id"))
        kv_out = None
        if kv_in.get("do_remote_decode"):
            kv_out = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": args.name,
                      "remote_block_ids": list(range(max(1, prompt_tokens // 16))), "remote_host": "127.0.0.1",
                      "remote_port": args.port, "tp_size": 1}
        served.labels("remote_prefilled" if remote_prefilled else "local").inc()
        request_id = request.headers.get("x-request-id") or f"standin-{uuid.uuid4().hex[:12]}"
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
            try:
                await asyncio.sleep(prefill_s + max(0, max_tokens - 1) * args.token_ms / 1000)
            finally:
                running.labels(args.model).dec()
            text = " ".join(WORDS[i % len(WORDS)] for i in range(max_tokens))
            payload = {"id": request_id, "object": obj, "created": created, "model": args.model,
                       "choices": [choice_piece(0, text, "length", False)], "usage": usage,
                       "kv_transfer_params": kv_out}
            return JSONResponse(payload, headers={"x-request-id": request_id})

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

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
                    yield f"data: {json.dumps(chunk)}\n\n"
                if include_usage:
                    yield f"data: {json.dumps({'id': request_id, 'object': obj, 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                running.labels(args.model).dec()

        headers = {"x-request-id": request_id}
        if args.path_header:
            headers[PATH_HEADER] = args.path_header
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    return Starlette(routes=[
        Route("/v1/models", models),
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/v1/completions", generate, methods=["POST"]),
        Route("/v1/chat/completions", generate, methods=["POST"]),
    ])


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
    parser.add_argument("--blocking-prefill", action="store_true",
                        help="do the prefill delay blocking the whole server, so every running stream stalls "
                             "meanwhile (head-of-line blocking as in a colocated engine)")
    parser.add_argument("--path-header", default=None,
                        help="answer streams with this x-pdlab-path header, as pdlab's router does")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)
    uvicorn.run(build_app(args), host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
