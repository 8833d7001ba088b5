"""Every command the documentation shows is executed, the way a user types it.

The commands are collected from README.md, docs/*.md (not docs/dev/, the maintainers' notes) and the markdown cells
of the notebooks: every line of a shell code block that starts with `pdlab`, `.venv/bin/pdlab` or `make` (after
`$ ` prompts and `VAR=value` prefixes; continued lines joined), and every inline code span that holds one.

Each one runs through the installed console script (`.venv/bin/pdlab`) or `make`, in a subprocess, from the
repository root:

- a *mention* (a command's name alone, e.g. `pdlab sim validate`) runs with `--help`: the command exists;
- every other command must have an entry in COMMANDS below, which says exactly what runs: the documented text as
  written, or with its quick flags (a long run shortened), or with its placeholders replaced (see PLACEHOLDERS).

A documented command with no entry fails `test_every_documented_command_has_a_way_to_run`, and so does an entry
no document shows any more: the table and the docs cannot drift apart.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import jupytext
import psutil
import pytest

from tests.conftest import REPO, make_argv, make_test_lab, pdlab_processes

#: Where commands are collected from (docs/dev/ holds maintainers' notes and histories, not the learner's docs).
DOC_GLOBS = ("README.md", "docs/*.md")
NOTEBOOK_GLOB = "notebooks/[0-9][0-9]-*.py"

BIN = Path(sys.executable).parent
PDLAB = str(BIN / "pdlab")

#: What each placeholder in COMMANDS stands for when the test runs it (the substitution table).
PLACEHOLDERS = {
    "{OUT}": "a fresh temporary directory of the test",
    "{LAB}": "labs/local-1p1d.yaml with the test model (pdlab-tiny) and ports of its own (tests/conftest.py "
             "make_test_lab): a lab whose deployment the command starts itself",
    "{DEPLOYMENT}": "the name of the test session's running 1P1D deployment (tests/conftest.py live_1p1d: started "
                    "with `pdlab up`, stopped with `pdlab down`)",
    "{ROUTER}": "that deployment's router URL",
    "{PREFILL}": "its prefill instance's URL",
    "{DECODE}": "its decode instance's URL",
    "{MODEL}": "its served model's name",
    "{TOKENIZER}": "its model directory (holds tokenizer.json)",
    "{RUN}": "a run directory of a recorded run shipped under data/results/",
    "{MODELS}": "pdlab's model folder (pdlab.settings.models_dir(): ~/.cache/pdlab/models unless $PDLAB_HOME)",
}


@dataclass(frozen=True)
class Way:
    """How the test runs one documented command."""

    argv: str
    """What runs, in shell words, with PLACEHOLDERS; `pdlab` is the installed console script."""
    needs: str = "cheap"
    """`cheap` (seconds, nothing running), `deployment` (the test session's running 1P1D deployment), `vllm` (starts
    vLLM instances of its own), `root` (network namespaces; skipped without root), `make`, `server` (a server that
    runs until stopped: started, checked, stopped), `kubectl` (calls the cluster's client: a stand-in here),
    `session` (run by the test session's own fixture, see `why`), `same` (`argv` names the entry that runs it),
    `test` (`argv` names another test that runs the command through the console script)."""
    why: str = ""
    """Why it runs this way, when it is not the documented text as written."""
    rc: int = 0
    """The exit status the documented command gives here (non-zero where the docs say it fails without a cluster)."""
    expect: str | None = None
    """Text its output must contain."""
    timeout: float = 120
    ready: str = ""
    """For a `server`: `printed` (the URL with a token it prints), or a URL that answers once it serves."""


AS_WRITTEN = "as written"

_CLUSTER_LAB = "labs/hyperpod-llama8b-1p1d.yaml"

def _quick_run(lab: str) -> str:
    """A secondary lab's documented run, made cheap: its workload, shortened, at the session deployment's router
    instead of its own deployments (`pdlab run --url`; the demo lab runs for real, deploying its scenarios)."""
    return (f"pdlab run {lab} --url {{ROUTER}} --model {{MODEL}} --tokenizer {{TOKENIZER}} --quick --duration 1 "
            "--out {OUT}/run")


QUICK_RUN_WHY = ("the lab's workload, 1 s of it, sent to the session deployment's router with `--url` (its own "
                 "deployments are the local kinds every other test starts)")

COMMANDS: dict[str, Way] = {
    # --- README: the two commands, set-up and the course
    "make demo": Way("make demo DEMO_ARGS='--quick --out {OUT}/demo'", "demo", expect="Verdict",
                     why="quick flags: the demo with its lab's quick loads (tests/conftest.py demo_run, shared with "
                         "the notebooks that read a demo run)"),
    "pdlab demo": Way("make demo", "same", why="`make demo` runs exactly `.venv/bin/pdlab demo $(DEMO_ARGS)` (checked "
                      "in test_pdlab_demo_is_what_make_demo_runs), and runs above with --quick"),
    "pdlab run labs/hol-blocking.yaml --quick": Way(
        "pdlab run labs/hol-blocking.yaml --quick --only disaggregated_lmcache --duration 3 --out {OUT}/run", "vllm",
        expect="LMCache pushed the KV of", why="the demo's lab through `pdlab run`: the scenario `make demo` leaves "
        "out (LMCache P/D, its load sized on the receiver), 3 s; the demo's scenarios and the baseline run quick in "
        "`make demo` above"),
    "pdlab run labs/hol-blocking.yaml": Way("pdlab run labs/hol-blocking.yaml --quick", "same",
                                            why="the same lab, run above with its quick flags"),
    "pdlab run labs/hol-blocking.yaml --only disaggregated --only disaggregated_lmcache": Way(
        "pdlab run labs/hol-blocking.yaml --quick", "same",
        why="the same lab: its LMCache scenario runs above with quick flags, its NIXL one in `make demo`"),
    "make test": Way("make -n test", "make", expect="pytest",
                     why="make test is what runs this test; a dry run checks it sets up and runs pytest"),
    "make setup": Way("make setup", "make", why=AS_WRITTEN),
    "make lab": Way("make lab", "server", ready="printed", timeout=180,
                    why="JupyterLab is started, asked for the page it prints (with its token), and stopped"),
    "make browser-deps": Way("make browser-deps", "make", why=AS_WRITTEN),
    # --- docs/labs.md: the quick start by hand
    "pdlab model make": Way("pdlab model make", why=AS_WRITTEN),
    "pdlab model make [NAME...]": Way("pdlab model make pdlab-tiny", why="NAME: the test model"),
    "pdlab up labs/local-1p1d.yaml": Way(
        "pdlab up {LAB}", "session", why="the test session's shared deployment is started exactly so, with the test "
        "model and ports of its own, by tests/conftest.py live_1p1d (which every `deployment` command here uses)"),
    "pdlab status": Way("pdlab status", "deployment", expect="pytest-1p1d", why=AS_WRITTEN),
    # --- docs/lmcache.md: LMCache's P/D behind the router
    "pdlab up labs/local-1p1d-lmcache.yaml --dry-run": Way("pdlab up labs/local-1p1d-lmcache.yaml --dry-run",
                                                           expect="LMCacheConnectorV1", why=AS_WRITTEN),
    "pdlab up labs/local-1p1d-lmcache.yaml": Way(
        "pdlab up {LAB}", "session", why="tests/lmcache/test_lmcache_pd.py starts this lab exactly so, with the test "
        "model and ports of its own, sends it requests through the router, and stops it with `pdlab down NAME`; it "
        "is an extended test (`pytest -m extended`), left out of make test for time. In make test the same launcher "
        "starts LMCache's P/D in notebook 03 (on nodes, as root) and in `pdlab run labs/hol-blocking.yaml --quick`"),
    "pdlab down local-1p1d-lmcache": Way(
        "pdlab down NAME", "session", why="tests/lmcache/test_lmcache_pd.py (extended) stops its LMCache deployment "
        "exactly so (under its own name) and checks nothing of it is left; make test runs `pdlab down NAME` on "
        "the session's deployment"),
    # --- the course (notebook 00, docs/course.md): what `pdlab up` would run, started nothing
    "pdlab up labs/local-1p1d.yaml --dry-run": Way("pdlab up labs/local-1p1d.yaml --dry-run",
                                                   expect="--kv-transfer-config", why=AS_WRITTEN),
    "pdlab down": Way("pdlab down", "session", why="tests/conftest.py live_1p1d stops the session's deployment "
                      "exactly so (its own state directory holds no other deployment) and checks nothing is left"),
    "pdlab run LAB --url URL --model NAME --tokenizer DIR": Way(
        "pdlab run labs/hol-blocking.yaml --url {ROUTER} --model {MODEL} --tokenizer {TOKENIZER} --quick --duration 3 "
        "--out {OUT}/run", "deployment", expect="Run directory", why="the demo lab's load for 3 s at the session's "
                                                                      "router"),
    "pdlab run labs/threshold-sweep.yaml": Way(_quick_run("labs/threshold-sweep.yaml"), "deployment",
                                               expect="Run directory", why=QUICK_RUN_WHY),
    "pdlab run labs/fault-drills.yaml": Way(_quick_run("labs/fault-drills.yaml"), "deployment",
                                            expect="Run directory", why=QUICK_RUN_WHY),
    "pdlab run labs/fault-drills-lmcache.yaml": Way(
        _quick_run("labs/fault-drills-lmcache.yaml"), "deployment", expect="Run directory",
        why=QUICK_RUN_WHY + " (its events are its scenario's: at an endpoint there is no instance to kill)"),
    "pdlab run labs/threshold-basis.yaml": Way(_quick_run("labs/threshold-basis.yaml"), "deployment",
                                               expect="Run directory", why=QUICK_RUN_WHY),
    "pdlab run labs/lmcache-offload.yaml": Way(
        _quick_run("labs/lmcache-offload.yaml"), "deployment", expect="Run directory",
        why=QUICK_RUN_WHY + "; tests/lmcache/test_lmcache_offload.py starts its LMCache scenario, on one instance"),
    "pdlab run labs/hol-blocking.yaml --url http://127.0.0.1:8000 --model meta-llama/Llama-3.1-8B-Instruct "
    "--tokenizer tokenizers/llama-3.1-8b --scenario cluster-1p1d": Way(
        "pdlab run labs/hol-blocking.yaml --url {ROUTER} --model {MODEL} --tokenizer {TOKENIZER} "
        "--scenario cluster-1p1d --quick --duration 3 --out {OUT}/run", "deployment", expect="cluster-1p1d",
        why="the session deployment's router stands for the cluster's; its model and tokenizer for Llama's"),
    # --- docs/benchmarks.md: each against the session deployment, cut to a few requests, into a test folder
    "pdlab bench admission [LAB] [--url URL --role ROLE]": Way(
        "pdlab bench admission --url {DECODE} --role decode --gaps 0,20 --repeats 1 --out {OUT}/a.json",
        "deployment", why="the session's decode instance, two gaps, one pair each"),
    "pdlab bench backtoback [LAB] [--prefill-url URL --decode-url URL]": Way(
        "pdlab bench backtoback --prefill-url {PREFILL} --decode-url {DECODE} --prompts 2 --tokens 512 --rounds 1 "
        "--out {OUT}/b.json", "deployment", why="the session's pair, two 512-token prompts, one round"),
    "pdlab bench prefill [LAB] [--url URL]": Way(
        "pdlab bench prefill --url {PREFILL} --lengths 64,512 --repeats 1 --out {OUT}/p.json", "deployment",
        why="the session's prefill instance, two lengths"),
    "pdlab bench streams [LAB] [--url URL --role ROLE]": Way(
        "pdlab bench streams --url {DECODE} --role decode --streams 0,1,2 --repeats 1 --out {OUT}/s.json",
        "deployment", why="the session's decode instance, 0, 1 and 2 background streams"),
    "pdlab bench transfer [LAB] [--deployment NAME]": Way(
        "pdlab bench transfer --deployment {DEPLOYMENT} --prompt-tokens 512 --busy-tokens 512 --repeats 1 "
        "--conditions idle --out {OUT}/t.json", "deployment", why="the session's deployment, the idle condition once"),
    "pdlab bench startup [LAB]": Way(
        "tests/benchmarks/test_record_discipline.py::test_startup_writes_under_runs", "test",
        why="that test runs `pdlab bench startup LAB` through the console script with a one-instance lab of the "
            "test model and checks where it writes (starting vLLM once more here would add ~40 s to make test)"),
    "pdlab bench phases [--model pdlab-small]": Way(
        "pdlab bench phases --model pdlab-tiny --lengths 64,256 --batches 1,4 --contexts 128 --repeats 1 "
        "--out-dir {OUT}", why="the test model, two points of each kind"),
    # --- the cluster tier (docs/cluster.md): `kubectl` is a stand-in on PATH that prints what it was asked
    "pdlab cluster render labs/hyperpod-llama8b-1p1d.yaml --target hyperpod --out out/hyperpod": Way(
        f"pdlab cluster render {_CLUSTER_LAB} --target hyperpod --out {{OUT}}/hyperpod", why="out/: a test folder"),
    "pdlab cluster render labs/hyperpod-llama8b-1p1d.yaml --target k8s --out out/k8s": Way(
        f"pdlab cluster render {_CLUSTER_LAB} --target k8s --out {{OUT}}/k8s", why="out/: a test folder"),
    "pdlab cluster render labs/hyperpod-llama8b-1p1d.yaml --target script --out out/script": Way(
        f"pdlab cluster render {_CLUSTER_LAB} --target script --out {{OUT}}/script", why="out/: a test folder"),
    "pdlab cluster render --target k8s|script": Way(
        f"pdlab cluster render {_CLUSTER_LAB} --target script --out {{OUT}}/script", why="the shipped cluster lab"),
    "pdlab cluster apply labs/hyperpod-llama8b-1p1d.yaml --target k8s --dry-run": Way(
        f"pdlab cluster apply {_CLUSTER_LAB} --target k8s --dry-run", expect="kubectl apply -f", why=AS_WRITTEN),
    "pdlab cluster apply labs/hyperpod-llama8b-1p1d.yaml --target k8s": Way(
        f"pdlab cluster apply {_CLUSTER_LAB} --target k8s", "kubectl", expect="stand-in kubectl apply -f",
        why=AS_WRITTEN),
    "pdlab cluster delete labs/hyperpod-llama8b-1p1d.yaml --target k8s": Way(
        f"pdlab cluster delete {_CLUSTER_LAB} --target k8s", "kubectl", expect="stand-in kubectl delete",
        why=AS_WRITTEN),
    "pdlab cluster status labs/hyperpod-llama8b-1p1d.yaml --target k8s": Way(
        f"pdlab cluster status {_CLUSTER_LAB} --target k8s", "kubectl", expect="stand-in kubectl get",
        why=AS_WRITTEN),
    # --- two nodes on one machine (docs/netlab.md)
    "sudo pdlab netlab check": Way("sudo pdlab netlab check", "root", expect="measured_mbps", why=AS_WRITTEN),
    "sudo pdlab netlab check --preset 1gbe --bytes 50000000": Way(
        "sudo pdlab netlab check --preset 1gbe --bytes 50000000", "root", expect="measured_mbps", why=AS_WRITTEN),
    "sudo pdlab netlab check --mbps 100": Way("sudo pdlab netlab check --mbps 100", "root", expect="measured_mbps",
                                              why=AS_WRITTEN),
    "sudo pdlab netlab check --mover nixl": Way("sudo pdlab netlab check --mover nixl", "root",
                                                expect="measured_mbps", why=AS_WRITTEN),
    "sudo pdlab netlab cleanup": Way("sudo pdlab netlab cleanup", "root", why=AS_WRITTEN),
    "pdlab netlab check --preset P --bytes 50000000 [--mover nixl]": Way(
        "pdlab netlab check --preset efa-p5 --bytes 50000000 --mover nixl", "root", expect="measured_mbps",
        why="P: the EFA preset"),
    # --- the simulator (docs/simulator.md, notebooks 07 and 08): simulations run as written, in seconds
    "pdlab sim run labs/sim/llama70b-h200-efa.yaml": Way("pdlab sim run labs/sim/llama70b-h200-efa.yaml",
                                                         why=AS_WRITTEN),
    "pdlab sim run labs/sim/kv-pressure.yaml": Way("pdlab sim run labs/sim/kv-pressure.yaml", why=AS_WRITTEN),
    "pdlab sim run labs/sim/hyperpod-llama70b-2p2d.yaml": Way("pdlab sim run labs/sim/hyperpod-llama70b-2p2d.yaml",
                                                              why=AS_WRITTEN),
    "pdlab sim search labs/sim/llama70b-h200-efa.yaml --gpus 16": Way(
        "pdlab sim search labs/sim/llama70b-h200-efa.yaml --gpus 16", why=AS_WRITTEN, timeout=300),
    "pdlab sim lab labs/hol-blocking.yaml": Way("pdlab sim lab labs/hol-blocking.yaml", why=AS_WRITTEN, timeout=300),
    "pdlab sim lab labs/hol-blocking.yaml --quick": Way("pdlab sim lab labs/hol-blocking.yaml --quick",
                                                        why=AS_WRITTEN),
    "pdlab sim published": Way("pdlab sim published", why=AS_WRITTEN, timeout=300),
    "pdlab sim published labs/sim/published/splitwise-llama2-70b-h100-tp8.yaml": Way(
        "pdlab sim published labs/sim/published/splitwise-llama2-70b-h100-tp8.yaml", why=AS_WRITTEN),
    "pdlab sim probe": Way("pdlab sim probe --deployment {DEPLOYMENT} --quick --out {OUT}/probe", "deployment",
                           why="the session's running pair probed with the quick points (`--deployment` instead of "
                               "bringing up its own; `--quick`: fewer, shorter points), into a test folder"),
    # --- labs the notebooks point at: their workloads, quick, at the session deployment
    "pdlab run labs/kv-pressure.yaml": Way(_quick_run("labs/kv-pressure.yaml"), "deployment",
                                           expect="Run directory", why=QUICK_RUN_WHY),
    # --- the router's overhead benchmark (docs/router.md), against its stand-ins, cut to a few requests
    "pdlab bench router": Way("pdlab bench router --profile", "same",
                              why="the profiled run is the same benchmark, with the pdlab router under cProfile"),
    "pdlab bench router --profile": Way("pdlab bench router --profile --requests 40 --rounds 1 --warmup 5 "
                                        "--out {OUT}/router-profile", expect="ms of its own CPU per request",
                                        why="40 requests per target and concurrency instead of 2,000, into a test "
                                            "folder", timeout=300),
    # --- the workshop kit (docs/troubleshooting.md, docs/facilitator.md)
    "pdlab preflight": Way("pdlab preflight", expect="Ready for the course", why=AS_WRITTEN),
    "pdlab preflight --json": Way("pdlab preflight --json", expect='"passed": true', why=AS_WRITTEN),
    "make preflight": Way("make -n preflight", "make", expect="preflight --serve",
                          why="a dry run: its recipe is `pdlab preflight --serve`, which tests/workshop/"
                              "test_preflight.py runs for real with the test model (a 1P1D deployment of its own)"),
    "make model": Way("make -n model", "make", expect="model make",
                      why="a dry run: its recipe is `pdlab model make` after set-up (run above as written); run "
                          "for real it would set up the venv it is given, which may be another checkout's"),
    # --- the router by hand (docs/router.md); its upstreams need not be up for it to serve
    "pdlab router serve --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8101 --model pdlab-small "
    "--tokenizer ~/.cache/pdlab/models/pdlab-small --threshold 4096 --prefill-strategy roundrobin "
    "--decode-strategy leastloaded --port 8000": Way(
        "pdlab router serve --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8101 --model pdlab-small "
        "--tokenizer {MODELS}/pdlab-small --threshold 4096 --prefill-strategy roundrobin "
        "--decode-strategy leastloaded --port 8000", "server", ready="http://127.0.0.1:8000/health",
        why="as written (~/.cache/pdlab/models is pdlab's model folder here)"),
}

# --- collecting the documented commands ----------------------------------------------------------------------------

_FENCE = re.compile(r"^\s*```\s*([\w+-]*)")
_INLINE = re.compile(r"`((?:\.venv/bin/)?(?:pdlab|make)(?: [^`]*)?)`")
_SHELL = {"", "bash", "sh", "shell", "console", "text"}
_COMMAND = re.compile(r"^(?:sudo\s+)?(?:\w+=\S+\s+)*(?:\.venv/bin/)?(?:pdlab|make)(?:\s|$)")


def _markdown_sources() -> list[tuple[str, str]]:
    sources = []
    for pattern in DOC_GLOBS:
        sources += [(str(path.relative_to(REPO)), path.read_text()) for path in sorted(REPO.glob(pattern))]
    for path in sorted(REPO.glob(NOTEBOOK_GLOB)):
        cells = jupytext.read(path).cells
        sources.append((str(path.relative_to(REPO)),
                        "\n\n".join(cell.source for cell in cells if cell.cell_type == "markdown")))
    return sources


def _normalise(command: str) -> str:
    command = re.sub(r"\s+", " ", command.strip())
    return re.sub(r"(^|\s)\.venv/bin/pdlab(?=\s|$)", r"\1pdlab", command)


def documented_commands() -> tuple[dict[str, list[str]], set[str]]:
    """Each documented command (normalised: `.venv/bin/pdlab` written as `pdlab`, whitespace collapsed) -> the
    files that show it; and the commands shown in a shell block (to type, never a mere mention)."""
    found: dict[str, list[str]] = {}
    typed: set[str] = set()

    def add(command: str, source: str, in_block: bool = False) -> None:
        command = _normalise(command)
        if command not in ("pdlab", "make"):
            found.setdefault(command, [])
            if source not in found[command]:
                found[command].append(source)
            if in_block:
                typed.add(command)

    for source, text in _markdown_sources():
        block: str | None = None
        pending = ""
        for line in text.splitlines():
            fence = _FENCE.match(line)
            if fence:
                block = None if block is not None else fence.group(1)
                pending = ""
                continue
            if block is not None:
                if block not in _SHELL:
                    continue
                line = pending + line.strip().removeprefix("$ ")
                if line.endswith("\\"):
                    pending = line[:-1] + " "
                    continue
                pending = ""
                line = re.sub(r"\s+#.*$", "", line).strip()
                if _COMMAND.match(line):
                    add(line, source, in_block=True)
            else:
                for match in _INLINE.finditer(line):
                    add(match.group(1), source)
    return found, typed


def _command_paths() -> set[tuple[str, ...]]:
    """Every command path the console script knows: ("sim",), ("sim", "validate"), ..."""
    import typer.main

    from pdlab.cli import app

    paths: set[tuple[str, ...]] = set()

    def walk(group: object, prefix: tuple[str, ...]) -> None:
        for name, command in getattr(group, "commands", {}).items():
            paths.add((*prefix, name))
            walk(command, (*prefix, name))

    walk(typer.main.get_command(app), ())
    return paths


_PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(?:\.(?:yaml|json|csv))?$")


def synopsis(command: str) -> tuple[list[tuple[str, ...]], list[str]] | None:
    """A command named in prose rather than typed: its name (`pdlab sim validate`), alternatives of one
    (`pdlab up/status/down`, `pdlab sim lab|fit`), or a synopsis of its options whose every other word is a
    PLACEHOLDER, `...` or `[...]` (`pdlab sim validate RUN_DIR... --profile P --out DIR`) -> the command paths it
    names and the options it shows; None for a command line with real values, which COMMANDS must run.
    The same words in a shell block are a command line to type, never a mention."""
    if command in TYPED:
        return None
    words = command.split()
    if words[0] != "pdlab":
        return None
    known = _command_paths()
    paths: list[tuple[str, ...]] = [()]
    rest = [w for w in words[1:] if w not in ("...", "…")]
    while rest:
        options = re.split(r"[/|]", rest[0])
        if not all((*paths[0], o) in known for o in options):
            break
        paths = [(*path, o) for path in paths for o in options]
        rest.pop(0)
    if paths == [()]:
        return None
    flags: list[str] = []
    for word in rest:
        for piece in re.split(r"[|]", word.strip("[]").removesuffix("...").removesuffix("…")):
            if piece.startswith("-"):
                flags.append(piece.split("=")[0])
            elif piece and not _PLACEHOLDER.match(piece):
                return None
    return paths, flags


DOCUMENTED, TYPED = documented_commands()
MENTIONS = sorted(c for c in DOCUMENTED if c not in COMMANDS and synopsis(c) is not None)
LISTED = {c: w for c, w in COMMANDS.items() if c in DOCUMENTED}


def test_every_documented_command_has_a_way_to_run() -> None:
    missing = {c: DOCUMENTED[c] for c in DOCUMENTED if c not in COMMANDS and c not in MENTIONS}
    stale = sorted(c for c in COMMANDS if c not in DOCUMENTED)
    assert not missing, ("documented commands no test runs; add each to COMMANDS in tests/test_docs_commands.py "
                         "(as written, with quick flags, or with placeholders):\n"
                         + "\n".join(f"  {c!r}  ({', '.join(s)})" for c, s in sorted(missing.items())))
    assert not stale, f"COMMANDS entries that no document shows any more (remove them): {stale}"
    unknown = {p for way in COMMANDS.values() for p in re.findall(r"\{[A-Z_]+\}", way.argv)} - set(PLACEHOLDERS)
    assert not unknown, f"placeholders with no entry in PLACEHOLDERS: {sorted(unknown)}"


@pytest.mark.parametrize("command", MENTIONS)
def test_a_mentioned_command_exists(command: str) -> None:
    """A command named in prose exists, with every option its synopsis shows (`--help` lists it)."""
    paths, flags = synopsis(command)  # type: ignore[misc]
    for path in paths:
        result = subprocess.run([PDLAB, *path, "--help"], capture_output=True, text=True, timeout=60, cwd=REPO,
                                env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"})
        assert result.returncode == 0, f"`pdlab {' '.join(path)} --help` failed:\n{result.stdout}\n{result.stderr}"
        missing = [flag for flag in flags if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", result.stdout)]
        assert not missing, f"`{command}` shows options `pdlab {' '.join(path)}` does not have: {missing}"


# --- running them ---------------------------------------------------------------------------------------------------


def _by_need(need: str) -> list[str]:
    return sorted(c for c, way in LISTED.items() if way.needs == need)


def _argv(way: Way, values: dict[str, str]) -> list[str]:
    text = way.argv
    for key, value in values.items():
        text = text.replace(key, shlex.quote(value))
    words = shlex.split(text)
    if words[0] == "sudo":  # the root-only tests run as root already (and sudo may not be installed)
        words = words[1:]
    head: list[str] = []
    if words[0] == "env":  # env VAR=value ... COMMAND: keep the assignments, look at the command after them
        k = next(i for i, word in enumerate(words[1:], 1) if "=" not in word)
        head, words = words[:k], words[k:]
    if words[0] == "pdlab":
        words[0] = PDLAB
    if words[0] == "make":
        words = make_argv(*words[1:])
    return head + words


def _env(extra_path: Path | None = None) -> dict[str, str]:
    # The console script and make find this venv first, as in a shell where the venv's bin is on PATH.
    path = os.pathsep.join(str(p) for p in (extra_path, BIN) if p is not None)
    return {**os.environ, "PATH": f"{path}{os.pathsep}{os.environ.get('PATH', '')}"}


def _run(command: str, values: dict[str, str], extra_path: Path | None = None) -> subprocess.CompletedProcess:
    way = COMMANDS[command]
    argv = _argv(way, values)
    result = subprocess.run(argv, capture_output=True, text=True, timeout=way.timeout, cwd=REPO,
                            env=_env(extra_path))
    shown = f"`{command}` ran as {shlex.join(argv)}:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    assert result.returncode == way.rc, shown
    if way.expect is not None:
        assert way.expect in result.stdout + result.stderr, shown
    return result


@pytest.fixture
def values(tmp_path: Path) -> dict[str, str]:
    from pdlab.settings import models_dir

    out = tmp_path / "out"
    out.mkdir()
    return {"{OUT}": str(out), "{LAB}": str(make_test_lab(tmp_path, "pytest-docs", base_port=8170)),
            "{RUN}": str(_recorded_run()), "{MODELS}": str(models_dir())}


def _recorded_run() -> Path:
    runs = sorted((REPO / "data" / "results" / "hol-blocking").glob("*/summary.json"))
    return runs[-1].parent if runs else REPO / "data" / "results"


def test_demo_entries_are_run_by_the_demo_fixture() -> None:
    assert [c for c in LISTED if LISTED[c].needs == "demo"] == ["make demo"], "one demo run per session"


@pytest.mark.parametrize("command", _by_need("cheap"))
def test_cheap_command(command: str, values: dict[str, str]) -> None:
    _run(command, values)


@pytest.mark.parametrize("command", _by_need("kubectl"))
def test_cluster_command_calls_kubectl(command: str, values: dict[str, str], tmp_path: Path) -> None:
    """A stand-in `kubectl` (a script on PATH) prints what pdlab asked of it: the cluster's own client is what runs."""
    stand_in = tmp_path / "bin"
    stand_in.mkdir()
    (stand_in / "kubectl").write_text('#!/bin/sh\necho "stand-in kubectl $*"\n')
    (stand_in / "kubectl").chmod(0o755)
    _run(command, values, extra_path=stand_in)


@pytest.mark.parametrize("command", _by_need("make"))
def test_make_command(command: str, values: dict[str, str]) -> None:
    if "setup" in command.split() and Path(sys.prefix).resolve() != (REPO / ".venv").resolve():
        pytest.skip("this checkout runs another checkout's venv: `make setup` would reinstall that venv from here")
    before = _tracked_changes()
    _run(command, values)
    assert _tracked_changes() == before, f"`{command}` changed tracked files"


def test_the_demo_as_a_learner_types_it(demo_run) -> None:
    """`make demo` (quick): it ends with the verdict and where to look next, and writes the summary in the shape
    README, the course and the simulator read, per-request figures included."""
    from pdlab.experiment.schema import check_summary

    assert COMMANDS["make demo"].expect in demo_run.output and "Next:" in demo_run.output, demo_run.output[-3000:]
    summary = json.loads((demo_run.dir / "summary.json").read_text())
    check_summary(summary)
    # the lab's headline (experiment.demo_scenarios), not its LMCache scenario (`pdlab run` runs that)
    assert summary["complete"] and set(summary["scenarios"]) == {"colocated", "colocated_chunked", "disaggregated"}
    for block in [*summary["scenarios"].values(), summary["baseline"]]:
        assert block["requests"]["sent"] == block["requests"]["completed"] > 0 and block["requests"]["failed"] == 0
        short = block["short"]
        assert {"p50", "p99", "max"} <= set(short["itl_ms"]) and short["ttft_ms"]["p99"] is not None
        assert short["worst_gap_ms"]["p99"] is not None and short["stalled"]["share"] is not None
        assert "count" in block["stalls"]
    assert all(summary["scenarios"][s]["long"]["ttft_ms"]["p50"] for s in ("colocated", "disaggregated"))
    workload = json.loads((demo_run.dir / "workload.json").read_text())
    assert workload["prefill_s"] > 0 and workload["rate"] > 0, "the demo's load was not sized on this machine"
    assert (demo_run.dir / "report.html").stat().st_size > 10_000


@pytest.mark.parametrize("command", _by_need("test"))
def test_the_test_named_runs_the_command(command: str) -> None:
    """An entry run by another test names it (path::function); that test exists and calls the console script with
    the command's words."""
    import ast

    path, name = COMMANDS[command].argv.split("::")
    tree = ast.parse((REPO / path).read_text())
    function = next((node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name), None)
    assert function is not None, f"{COMMANDS[command].argv} does not exist"
    words = [w for w in command.split()[1:] if not w.startswith("[")]
    calls = [[arg.value for arg in node.args if isinstance(arg, ast.Constant)] for node in ast.walk(function)
             if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "pdlab"]
    assert any(call[:len(words)] == words for call in calls), f"{name} no longer runs `pdlab {' '.join(words)}`"


def test_pdlab_demo_is_what_make_demo_runs() -> None:
    """`pdlab demo` in the docs is covered by the `make demo` run: make's recipe is exactly that command."""
    recipe = subprocess.run(make_argv("-n", "demo", "DEMO_ARGS=--quick"), cwd=REPO, capture_output=True, text=True)
    assert recipe.returncode == 0, recipe.stderr
    assert any(line.split()[-2:] == ["demo", "--quick"] and line.split()[0].endswith("/pdlab")
               for line in recipe.stdout.splitlines()), recipe.stdout
    assert all(way.argv in COMMANDS and COMMANDS[way.argv].needs != "same" for way in COMMANDS.values()
               if way.needs == "same"), "a `same` entry must name a command the table runs itself"


@pytest.mark.parametrize("command", _by_need("vllm"))
def test_command_that_starts_vllm(command: str, values: dict[str, str]) -> None:
    _run(command, values)
    # A lab run: every request it sent completed and, where LMCache moved the KV, every prompt sent through
    # prefill -> decode was pushed and loaded whole (no silent recompute), by LMCache's own account.
    for summary_path in Path(values["{OUT}"]).glob("*/summary.json"):
        summary = json.loads(summary_path.read_text())
        for name, block in summary["scenarios"].items():
            assert block["requests"]["completed"] == block["requests"]["sent"] > 0, (name, block["requests"])
        for name, kv in summary["kv_transfer"].items():
            if "lmcache" in kv:
                account = kv["lmcache"]
                assert account["disaggregated"] > 0, f"{name}: no prompt went through prefill -> decode"
                assert account["pushed"] == account["loaded_in_full"] == account["disaggregated"], (name, account)
                assert account["recomputed"] == 0, (name, account)
    leftovers = [p.cmdline() for p in pdlab_processes("vllm.entrypoints") if "--port 817" in " ".join(p.cmdline())]
    assert not leftovers, f"`{command}` left vLLM running: {leftovers}"


@pytest.mark.parametrize("command", _by_need("deployment"))
def test_command_against_the_session_deployment(command: str, values: dict[str, str], live_1p1d) -> None:
    dep = live_1p1d
    values = {**values, "{DEPLOYMENT}": dep.spec.name, "{ROUTER}": str(dep.router_url),
              "{PREFILL}": dep.urls("prefill")[0], "{DECODE}": dep.urls("decode")[0], "{MODEL}": dep.served_model,
              "{TOKENIZER}": str(dep.model_dir)}
    _run(command, values)


def test_the_session_deployment_is_the_quick_start(live_1p1d) -> None:
    """`pdlab up labs/local-1p1d.yaml` and `pdlab down` are run by the session fixture: its lab is the quick start's,
    with the test model and ports of its own, brought up and down through the console script."""
    import inspect

    from tests import conftest

    source = inspect.getsource(conftest.live_1p1d)
    down = inspect.getsource(conftest.pdlab_down)
    assert 'run_pdlab("up"' in source and "pdlab_down(None" in source and 'run_pdlab("down"' in down, \
        "the fixture no longer runs `pdlab up` and `pdlab down`"
    assert "local-1p1d.yaml" in inspect.getsource(conftest.make_test_lab)
    assert live_1p1d.spec.name == "pytest-1p1d"


@pytest.mark.parametrize("command", _by_need("root"))
def test_root_command(command: str, values: dict[str, str]) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    _run(command, values)


@pytest.mark.parametrize("command", _by_need("server"))
def test_server_command(command: str, values: dict[str, str]) -> None:
    """A command that serves until stopped: started in its own process group, asked for its page, then stopped with
    Ctrl-C as a user would, leaving nothing behind."""
    way = COMMANDS[command]
    env = {**_env(), "PDLAB_ADMIN_TOKEN": "docs-test-token"}
    tracked_before = _tracked_changes()
    proc = subprocess.Popen(_argv(way, values), cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore
    reader.start()
    try:
        deadline = time.monotonic() + way.timeout
        answered = None
        while time.monotonic() < deadline and answered is None and proc.poll() is None:
            time.sleep(0.5)
            if way.ready == "printed":
                found = re.findall(r"(http://127\.0\.0\.1:\d+/\S*token=\w+)", "".join(seen))
                url = found[0] if found else None
            else:
                url = way.ready
            if url:
                try:
                    answered = httpx.get(url, timeout=10, follow_redirects=True).status_code
                except httpx.HTTPError:
                    answered = None
        assert answered is not None, f"`{command}` never answered:\n{''.join(seen)[-4000:]}"
        assert answered < 500 or way.ready != "printed", f"`{command}` answered {answered}"
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"`{command}` did not stop on Ctrl-C")
    alive = [p for p in psutil.process_iter() if _in_group(p, proc.pid)]
    assert not alive, f"`{command}` left processes of its group running: {alive}"
    # `make lab` pairs the notebooks with jupytext: a jupytext other than the one that wrote them must not rewrite
    # their sources (their headers leave its version out).
    assert _tracked_changes() == tracked_before, f"`{command}` changed tracked files"


def _tracked_changes() -> str:
    """`git diff` of the tracked files, as it stands."""
    return subprocess.run(["git", "diff"], cwd=REPO, capture_output=True, text=True, check=True).stdout


def _in_group(process: psutil.Process, group: int) -> bool:
    try:
        return os.getpgid(process.pid) == group
    except (ProcessLookupError, psutil.Error):
        return False


def _tracked_changes() -> str:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        return ""
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                          text=True).stdout
