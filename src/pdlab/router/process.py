"""The router as its own process: the command line and environment a launcher (or a cluster renderer) starts it
with. One mapping, `RouterSpec` + `RouterUpstreams` -> `pdlab router serve` options (pdlab.config.options)."""

from __future__ import annotations

import sys

from pdlab.config.options import spec_argv
from pdlab.config.router import RouterSpec, RouterUpstreams
from pdlab.settings import ADMIN_TOKEN_ENV

#: How a launcher on this machine runs the router (the same command as `pdlab router serve`).
LOCAL_PROGRAM = (sys.executable, "-m", "pdlab.router", "serve")


def router_command(spec: RouterSpec, upstreams: RouterUpstreams, program: tuple[str, ...] | list[str] = LOCAL_PROGRAM,
                   **overrides: object) -> list[str]:
    """`program` followed by the options of `upstreams` and `spec` (only those that differ from the defaults).
    `overrides` replace spec fields for this command line only (a cluster router binds `host="0.0.0.0"`). The admin
    token never goes on it: see `router_env`."""
    if overrides:
        spec = spec.model_copy(update=overrides)
    return [*program, *spec_argv(upstreams), *spec_argv(spec)]


def router_env(spec: RouterSpec, base: dict[str, str], token: str | None = None) -> dict[str, str]:
    """The router's environment: `base` plus the admin token (the spec's, else `token`) in $PDLAB_ADMIN_TOKEN."""
    env = dict(base)
    secret = spec.admin_secret() or token
    if secret:
        env[ADMIN_TOKEN_ENV] = secret
    return env
