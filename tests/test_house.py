"""The house follows the data: a module under src/pdlab imports only from its own room and the rooms below it.

The order is written here, once. The serving path, bottom to top: config (specs, settings) -> model (the local
models, shapes, accelerators) -> lmcache (LMCache's settings for every tier, its push reports and figures, the
connector vLLM loads) -> router (the P/D router and the request protocol it speaks) -> netlab (two nodes' network
on one machine) -> deploy (processes: vLLM instances, the router, the network they need) -> load -> metrics ->
report -> experiment. The simulator's model and the cluster tier stand beside the path: each may import the path up
to the room named below, and nothing on the path imports them. The wings stand above everything: benchmarks, then
calibration (which reads runs and probes), then the course, then the top-level command line that gathers every
room's commands. docs/architecture.md draws the house.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

SERVING_PATH = ("config", "model", "lmcache", "router", "netlab", "deploy", "load", "metrics", "report", "experiment")
#: Room beside the path -> the highest room on the path it may import.
BESIDE = {"sim": "router", "cluster": "router"}
WINGS = ("benchmarks", "calibration", "course", "workshop", "cli")
#: Top-level modules, by room (a package is its own room).
MODULE_ROOMS = {"pdlab": "config", "pdlab.settings": "config", "pdlab.environment": "config",
                "pdlab.sse": "router", "pdlab.pdrequest": "router",
                "pdlab.course": "course", "pdlab.course_widgets": "course", "pdlab.cli": "cli"}


def room_of(module: str) -> str:
    if module in MODULE_ROOMS:
        return MODULE_ROOMS[module]
    room = module.split(".")[1]
    assert room in (*SERVING_PATH, *BESIDE, *WINGS), f"{module}: in no room of the house; give it one here"
    return room


def may_import(room: str) -> set[str]:
    """The rooms `room` may import from: its own and those below it."""
    if room in SERVING_PATH:
        return set(SERVING_PATH[: SERVING_PATH.index(room) + 1])
    if room in BESIDE:
        return set(SERVING_PATH[: SERVING_PATH.index(BESIDE[room]) + 1]) | {room}
    return set(SERVING_PATH) | set(BESIDE) | set(WINGS[: WINGS.index(room) + 1])


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / "pdlab").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported(module: str, source: str, is_package: bool, known: set[str]) -> list[tuple[int, str]]:
    """(line, module) for every pdlab module `module` imports, anywhere in it (functions and TYPE_CHECKING too)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:  # `from pdlab import model` imports the module pdlab.model
                found.append((node.lineno, f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base))
    return [(line, name) for line, name in found if name == "pdlab" or name.startswith("pdlab.")]


def upward_imports(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Every import of a module from a room above its own, in `sources` (module -> its text, whether a package)."""
    upward = []
    for module, (source, is_package) in sources.items():
        room = room_of(module)
        for line, target in imported(module, source, is_package, set(sources)):
            if room_of(target) not in may_import(room):
                upward.append(f"{module}:{line} ({room}) imports {target} ({room_of(target)})")
    return upward


def test_every_module_imports_only_from_rooms_below_it() -> None:
    sources = {module: (path.read_text(), path.name == "__init__.py") for module, path in modules().items()}
    upward = upward_imports(sources)
    assert not upward, "imports from a room above (move the code to the room it belongs in):\n" + "\n".join(upward)


def test_the_check_sees_an_upward_import() -> None:
    """The rule itself, on a made-up house: the path looks only down, the rooms beside it only at the path below
    them, the wings at everything below."""
    house = {
        "pdlab.load.schedule": ("from pdlab.experiment import runner\nfrom pdlab import model\n", False),
        "pdlab.experiment.runner": ("def f():\n    from pdlab.sim.scenario import simulate\n", False),
        "pdlab.sim.scenario": ("from ..router import strategies\nfrom pdlab.deploy import launcher\n", False),
        "pdlab.calibration.lab": ("import pdlab.experiment.runner\nfrom pdlab.sim import scenario\n", False),
        "pdlab.benchmarks.prefill": ("from pdlab.calibration import lab\n", False),
        "pdlab.model": ("", True), "pdlab.router.strategies": ("", False), "pdlab.deploy.launcher": ("", False),
    }
    assert upward_imports(house) == [
        "pdlab.load.schedule:1 (load) imports pdlab.experiment.runner (experiment)",
        "pdlab.experiment.runner:2 (experiment) imports pdlab.sim.scenario (sim)",
        "pdlab.sim.scenario:2 (sim) imports pdlab.deploy.launcher (deploy)",
        "pdlab.benchmarks.prefill:1 (benchmarks) imports pdlab.calibration.lab (calibration)",
    ]


def test_the_command_line_starts_without_the_serving_path() -> None:
    """`pdlab` loads what a command needs when it runs: starting the command line (every `pdlab ...`, and `--help`)
    imports no deployment launcher, tokenizer, locust or pandas (the rooms' packages give their names on first use).
    Each of those took tenths of a second at every start."""
    import subprocess
    import sys

    heavy = ("pdlab.deploy.launcher", "pdlab.load.prompts", "pdlab.metrics.goodput", "tokenizers", "pandas", "locust")
    done = subprocess.run([sys.executable, "-c", "import sys, pdlab.cli; "
                           f"print([m for m in {heavy!r} if m in sys.modules])"],
                          capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", f"imported when the command line starts: {done.stdout.strip()}"


def test_every_lazy_name_resolves() -> None:
    """The packages that give their names on first use give every name they export, from the module that has it."""
    import importlib

    missing = [f"{package}.{name}" for package in ("pdlab.deploy", "pdlab.load", "pdlab.metrics")
               for name in importlib.import_module(package).__all__
               if not hasattr(importlib.import_module(package), name)]
    assert not missing, f"exported but not given: {missing}"
