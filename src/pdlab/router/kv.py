"""The router's P/D protocols: how its two legs tell the instances where a prompt's KV cache goes.

Each protocol is a small class registered by name (as vLLM's KVConnectorFactory registers connectors); the router
asks the registry for the one its `kv_protocol` names and never branches on which it is. Per request it opens a
`Transfer` (the prefill leg's parameters; what to wait for before the decode leg) and asks for the decode leg's
parameters from prefill's answer.

- `nixl` (vLLM's NixlConnector; decode pulls): prefill gets `kv_transfer_params={"do_remote_decode": true, ...}`
  and answers with the parameters of the KV it keeps; decode gets the client's request plus those parameters.
- `lmcache` (LMCacheConnectorV1's P/D; prefill pushes): prefill gets a `disagg_spec` naming the decode replica's
  LMCache receiver (host and per-rank ports); decode gets the client's request unchanged and finds the pushed KV by
  its token hashes. A request without a `disagg_spec` kills an LMCache sender's engine, so nothing plain is ever
  sent to a prefill instance under this protocol (`prefill_serves_plain` is False). Where the prefill instances
  report finished pushes to the router (`lmcache_notify_port`, pdlab.lmcache.push), the decode leg waits for the
  report: prefill's answer can come before the KV has landed.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import urlsplit

from pdlab.config.router import RouterUpstreams
from pdlab.lmcache.push import PushTimeout, PushWatch
from pdlab.pdrequest import PREFILL_KV_PARAMS, lmcache_kv_params


class KVProtocolError(ValueError):
    """A protocol that cannot work with the upstreams given (e.g. LMCache without receiver ports)."""


class KVTransferFailed(RuntimeError):
    """The KV of a prefilled prompt did not reach its decode replica (e.g. a push never reported): the request
    fails with this message rather than decoding without its KV."""


@dataclass
class Transfer:
    """One request's KV transfer, from the prefill request to the decode request."""

    prefill_params: dict[str, Any]
    """The prefill request's `kv_transfer_params`."""

    async def landed(self) -> float | None:
        """Wait until the KV is where the decode request will look for it (after prefill answered); returns the
        seconds waited (None: nothing to wait for). Raises KVTransferFailed when it will not arrive."""
        return None

    def close(self) -> None:
        """The request is done with the transfer (answered, failed or abandoned)."""


class KVProtocolHandler(ABC):
    """One P/D protocol. Subclasses set `name` and the class facts below and implement the two legs' parameters."""

    name: ClassVar[str]
    prefill_serves_plain: ClassVar[bool]
    """Whether a prefill instance may be sent a plain request (no P/D parameters), e.g. to serve it as colocated
    while no decode instance is available."""
    prefill_answer_carries_params: ClassVar[bool]
    """Whether prefill's answer carries `kv_transfer_params` for decode (counted in
    `pdlab_router_kv_transfer_params_total`)."""

    def __init__(self, upstreams: RouterUpstreams):
        self.upstreams = upstreams

    async def start(self) -> None:  # noqa: B027 (an optional hook)
        """Set up what the protocol needs while the router runs (a listener, ...)."""

    async def close(self) -> None:  # noqa: B027 (an optional hook)
        """Undo `start`."""

    def open_transfer(self, request_id: str, decode_url: str) -> Transfer:
        """A transfer of request `request_id`'s KV to the decode replica `decode_url` (chosen already)."""
        return Transfer(self.prefill_params(request_id, decode_url))

    @abstractmethod
    def prefill_params(self, request_id: str, decode_url: str) -> dict[str, Any]:
        """The prefill request's `kv_transfer_params`, the decode replica `decode_url` having been chosen."""

    @abstractmethod
    def decode_params(self, prefill_answer: dict[str, Any] | None) -> dict[str, Any] | None:
        """The decode request's `kv_transfer_params` from prefill's answer's; None sends the client's request as
        it came."""

    def describe(self) -> dict[str, Any]:
        """Read-only facts shown by `GET /admin/config`."""
        return {}


KV_PROTOCOLS: dict[str, type[KVProtocolHandler]] = {}


def register_kv_protocol(cls: type[KVProtocolHandler]) -> type[KVProtocolHandler]:
    """Class decorator: make `cls` available under `cls.name`."""
    if cls.name in KV_PROTOCOLS:
        raise ValueError(f"KV protocol {cls.name!r} is registered already")
    KV_PROTOCOLS[cls.name] = cls
    return cls


def make_kv_protocol(name: str, upstreams: RouterUpstreams) -> KVProtocolHandler:
    try:
        cls = KV_PROTOCOLS[name]
    except KeyError:
        raise KVProtocolError(f"unknown kv_protocol {name!r}; known: {', '.join(KV_PROTOCOLS)}") from None
    return cls(upstreams)


@register_kv_protocol
class NixlPull(KVProtocolHandler):
    """vLLM's NixlConnector: prefill keeps the KV; decode pulls it with the handle prefill answered with."""

    name = "nixl"
    prefill_serves_plain = True  # a kv_both NixlConnector instance serves a plain request as a colocated one
    prefill_answer_carries_params = True

    def prefill_params(self, request_id: str, decode_url: str) -> dict[str, Any]:
        return dict(PREFILL_KV_PARAMS)

    def decode_params(self, prefill_answer: dict[str, Any] | None) -> dict[str, Any] | None:
        return prefill_answer


@dataclass
class LMCacheTransfer(Transfer):
    """One push: landed once the prefill instance has reported it (when the router hears reports at all)."""

    watch: PushWatch | None = None
    push_id: str = ""
    timeout_s: float = 30.0
    decode_url: str = ""

    def __post_init__(self) -> None:
        # Watch before the prefill request goes: the report may come before its answer.
        self._reported = self.watch.expect(self.push_id) if self.watch is not None else None

    async def landed(self) -> float | None:
        if self.watch is None or self._reported is None:
            return None
        try:
            return await self.watch.wait(self.push_id, self._reported, self.timeout_s)
        except PushTimeout:
            raise KVTransferFailed(
                f"the KV push of this prompt to decode instance {self.decode_url} was not reported within "
                f"{self.timeout_s:g} s (lmcache_push_timeout_s; the lab's connector.lmcache.push_timeout_s): the "
                "request fails rather than decoding without its KV") from None

    def close(self) -> None:
        if self.watch is not None:
            self.watch.forget(self.push_id)


@register_kv_protocol
class LMCachePush(KVProtocolHandler):
    """LMCache's P/D: prefill pushes the KV to the decode replica's receiver named in its `disagg_spec`."""

    name = "lmcache"
    prefill_serves_plain = False  # an LMCache sender's engine dies on a request without a disagg_spec
    prefill_answer_carries_params = False

    def __init__(self, upstreams: RouterUpstreams):
        super().__init__(upstreams)
        ports = upstreams.lmcache_receiver
        if ports is None:
            raise KVProtocolError("kv_protocol `lmcache` needs the decode replicas' LMCache receiver ports "
                                  "(--lmcache-init-ports and --lmcache-alloc-ports: their pd_peer_init_port and "
                                  "pd_peer_alloc_port lists)")
        self.receivers: dict[str, dict[str, Any]] = {}
        for url in upstreams.decode:
            host = urlsplit(url).hostname
            if not host:
                raise KVProtocolError(f"decode URL {url!r} has no host to name as LMCache receiver")
            self.receivers[url.rstrip("/")] = {"receiver_host": host, "receiver_init_port": list(ports.init_ports),
                                               "receiver_alloc_port": list(ports.alloc_ports)}
        self.watch: PushWatch | None = None

    async def start(self) -> None:
        if self.upstreams.lmcache_notify_port is not None:
            # The prefill instances report to the router's own address (their pd_proxy_host).
            self.watch = PushWatch(self.upstreams.lmcache_notify_host, self.upstreams.lmcache_notify_port)
            await self.watch.start()

    async def close(self) -> None:
        if self.watch is not None:
            await self.watch.close()
            self.watch = None

    def open_transfer(self, request_id: str, decode_url: str) -> Transfer:
        # LMCache keys each push by this id (the receiver's buffer reservation, the report): unique per request
        # even when clients repeat an x-request-id.
        push_id = f"{request_id}.{uuid.uuid4().hex[:12]}"
        return LMCacheTransfer(self.prefill_params(push_id, decode_url), self.watch, push_id,
                               self.upstreams.lmcache_push_timeout_s, decode_url)

    def prefill_params(self, request_id: str, decode_url: str) -> dict[str, Any]:
        receiver = self.receivers[decode_url]
        return lmcache_kv_params(request_id, receiver["receiver_host"], receiver["receiver_init_port"],
                                 receiver["receiver_alloc_port"])

    def decode_params(self, prefill_answer: dict[str, Any] | None) -> dict[str, Any] | None:
        return None  # the KV is on its way to the decode replica, found there by its token hashes

    def describe(self) -> dict[str, Any]:
        return {"lmcache_receivers": self.receivers}
