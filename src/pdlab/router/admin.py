"""A client of the router's admin API (`GET`/`PUT /admin/config`), for whatever changes a running router's
settings: experiments and sweeps, the course's widgets, benchmarks."""

from __future__ import annotations

from typing import Any

import httpx


class AdminError(RuntimeError):
    """The router refused the change (the message carries its error) or could not be reached."""


class RouterAdmin:
    """`RouterAdmin(url, token).update(threshold=1024)`; `config()` reads the settings in force."""

    def __init__(self, url: str, token: str | None, timeout_s: float = 10.0):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    def _call(self, method: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            response = httpx.request(method, self.url + "/admin/config", json=body, headers=headers,
                                     timeout=self.timeout_s)
        except httpx.HTTPError as error:
            raise AdminError(f"router at {self.url} unreachable: {type(error).__name__}: {error}") from None
        if response.status_code != 200:
            what = f"refused {body}" if body is not None else "refused to show its settings"
            raise AdminError(f"router {what}: HTTP {response.status_code} {response.text}")
        return response.json()

    def config(self) -> dict[str, Any]:
        return self._call("GET")

    def update(self, **settings: Any) -> dict[str, Any]:
        """Change live settings; returns the settings the router now runs with."""
        return self._call("PUT", settings)
