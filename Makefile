# flowsched: `make demo` (set up + contention benchmark) and `make test` (set up + all checks).
# another interpreter: `make PYTHON=python3.13 VENV=.venv-3.13 test` (a venv of its own)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: setup demo wheel test lint typecheck plugin plugin-test pytest bench clean

SETUP_INPUTS := pyproject.toml scripts/setup.sh scripts/constraints.txt $(wildcard setup.py) $(wildcard nccl_plugin/src/*) $(wildcard nccl_plugin/include/nccl/*.h)

setup: $(VENV)/.installed

$(VENV)/.installed: $(SETUP_INPUTS)
	PYTHON="$(PYTHON)" bash scripts/setup.sh $(VENV)
	touch $@

# What the benchmark needs, without torch and the test tools (a fresh clone's setup: 1.5 min
# against 2.3); a full `make setup` also satisfies it.
$(VENV)/.installed-demo: $(SETUP_INPUTS)
	PYTHON="$(PYTHON)" bash scripts/setup.sh $(VENV) plot
	touch $@

# The main job: the contention benchmark on the embedded local testbed (falls back to the
# simulator, and says so, without root or the needed kernel features).
demo: $(if $(wildcard $(VENV)/.installed),setup,$(VENV)/.installed-demo)
	$(BIN)/flowsched bench contention --out results/contention

# A wheel in dist/ (with the plugin when a C compiler is there; FLOWSCHED_SKIP_PLUGIN=1 without)
wheel: setup
	$(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w dist .

lint: setup
	$(BIN)/ruff check flowsched tests bench
	$(BIN)/ruff format --check flowsched tests bench

typecheck: setup
	$(BIN)/mypy

plugin: setup
	$(MAKE) -C nccl_plugin PYTHON=$(abspath $(BIN))/python

plugin-test: setup
	$(MAKE) -C nccl_plugin check PYTHON=$(abspath $(BIN))/python

# pytest exits 5 when it collected no test; make treats every non-zero status as a failure.
pytest: setup
	$(BIN)/python -m pytest -q

test: lint typecheck plugin-test pytest

clean:
	rm -rf $(VENV) build dist *.egg-info nccl_plugin/build flowsched/_plugin/*.so
