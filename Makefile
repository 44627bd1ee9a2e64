# Two commands on a fresh machine (Python 3.11, no GPU):  make demo   |   make test
PY        ?= python3.11
VENV      ?= .venv
BIN       := $(VENV)/bin
STAMP     := $(VENV)/.installed
ROOT      ?= .miles
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1
# where PYTHONDONTWRITEBYTECODE is set (this machine, CI) every process would compile every module
# it imports, each time (+4 s for torch + transformers + dagster + ray): the targets here let Python
# write a module's .pyc the first time it is imported (into __pycache__ dirs git ignores)
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install system-deps demo demo-diffusion demo-vlm test test-fast test-extended lint ui viewer bench bench-trl-env clean

# apt packages: libibverbs1 for Mooncake's TCP transfer engine, chromium for the UI test.
system-deps:
	@if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  need=""; for p in libibverbs1 chromium chromium-driver; do dpkg -s $$p >/dev/null 2>&1 || need="$$need $$p"; done; \
	  if [ -n "$$need" ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$need >/dev/null; fi; \
	else echo "system-deps: not root or no apt-get; skipping (UI test will skip without chromium)"; fi

# torch first, with pip: the pinned CPU wheel (pip finds it in the machine's wheel dir; uv does not
# look there), then pinned by a constraint so nothing pulls a CUDA build. The rest with uv: the same
# versions pip resolves (measured 2026-12-05: ~25 s instead of ~110 s); pip if uv fails.
# Nothing is byte-compiled at install: a module is compiled the first time a process imports it and
# its .pyc written then (PYTHONDONTWRITEBYTECODE is unexported above), so only the modules something
# imports are compiled, once. Compiling all 28.7k modules of the venv took ~88 CPU-s, most of the
# install's CPU (2026-12-06). `make test` first compiles the ~5.3k its collection imports, on every
# core (scripts/warm_bytecode.py): its xdist workers would otherwise each compile all of them.
# Every extra but gpu: the runtime set (what the code imports) holds no test, bench or lint tool.
EXTRAS    := mooncake,ui-test,trackers,k8s,bench,test,dev
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile torch==2.13.0
	echo torch==2.13.0 > $(VENV)/constraints.txt
	{ $(BIN)/pip install -q --no-compile uv==0.13.9 && \
	  $(BIN)/uv pip install -q --python $(BIN)/python -c $(VENV)/constraints.txt -e '.[$(EXTRAS)]'; } || \
	$(BIN)/pip install -q --no-compile -c $(VENV)/constraints.txt -e '.[$(EXTRAS)]'
	touch $(STAMP)

install: system-deps $(STAMP)

demo: install
	$(BIN)/miles-platform quickstart --storage-root $(ROOT)

# the diffusion campaign: attribute task -> tiny DiT SFT base -> Flow-GRPO -> held-out evals
demo-diffusion: install
	$(BIN)/miles-platform quickstart --task diffusion --storage-root $(ROOT)

# the vision-language campaign: image counting task -> tiny Qwen3-VL SFT base -> GRPO -> held-out evals
demo-vlm: install
	$(BIN)/miles-platform quickstart --task vlm --storage-root $(ROOT)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# pytest-xdist: TEST_WORKERS processes (the 2 cores here), one file per worker at a time, in the
# order tests/conftest.py gives (longest files first; xdist's default reorders by test count).
# 3 workers measured the same as 2 on a fresh clone on 2026-12-05 (632 s vs 634 s): the CPU is the limit
TEST_WORKERS ?= 2
XDIST     := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: install lint
	$(BIN)/python scripts/warm_bytecode.py
	$(BIN)/python -m pytest -q -m "not gpu and not extended" $(XDIST) --durations=15

# checks each built of parts `make test` already checks one by one (a family's loop or layout on top
# of its bridge's parity and step tests), kept out of its 10-minute budget; run before touching those parts
test-extended: install
	$(BIN)/python scripts/warm_bytecode.py
	$(BIN)/python -m pytest -q -m "extended and not gpu" $(XDIST)

# the inner loop: tests/unit + tests/dagster without the ~15 s+ tests (SFT bases, gloo groups, whole
# runs); tests/e2e (the loop, learning, crash matrix, cluster, browser) and tests/gpu only in `make test`
test-fast: install
	$(BIN)/python scripts/warm_bytecode.py
	$(BIN)/python -m pytest -q -m "not gpu and not slow" $(XDIST) tests/unit tests/dagster

# dagster dev against the demo instance; Ctrl-C (or SIGTERM to make) stops every process it started
ui: install
	DAGSTER_HOME=$(abspath $(ROOT))/dagster MILES_STORAGE_ROOT=$(abspath $(ROOT)) \
	  $(BIN)/python scripts/ui.py -w workspace.yaml -h 127.0.0.1 -p 3000

# the rollout viewer over the demo's root on 127.0.0.1:$(VIEWER_PORT); it prints its URL with a token.
# `MILES_VIEWER_URL=http://127.0.0.1:8700 make ui` links each partition in the Dagster UI to it
VIEWER_PORT ?= 8700
viewer: install
	$(BIN)/miles-platform viewer --storage-root $(ROOT) --port $(VIEWER_PORT)

# compares with bench/baseline.json at the end; `make bench BENCH_ARGS=--update-baseline` rewrites it
BENCH_ARGS ?=
bench: install
	$(BIN)/python -m bench.run_all $(BENCH_ARGS)

# TRL's GRPOTrainer, the e2e bench's further baseline, in its own venv (never .venv: its pins stay)
TRL_VENV  ?= .venv-trl
$(TRL_VENV)/.installed: requirements-trl.txt
	$(PY) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/pip install -q torch==2.13.0
	echo torch==2.13.0 > $(TRL_VENV)/constraints.txt
	{ $(TRL_VENV)/bin/pip install -q uv==0.13.9 && \
	  $(TRL_VENV)/bin/uv pip install -q --compile-bytecode --python $(TRL_VENV)/bin/python \
	    -c $(TRL_VENV)/constraints.txt -r requirements-trl.txt; } || \
	  $(TRL_VENV)/bin/pip install -q -c $(TRL_VENV)/constraints.txt -r requirements-trl.txt
	touch $@

bench-trl-env: $(TRL_VENV)/.installed

clean:
	rm -rf $(VENV) $(TRL_VENV) $(ROOT) .pytest_cache .ruff_cache
