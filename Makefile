# flowsched: `make demo` (set up + contention benchmark) and `make test` (set up + all checks).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: setup demo test lint typecheck plugin plugin-test pytest bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup.sh $(wildcard setup.py) $(wildcard nccl_plugin/src/*) $(wildcard nccl_plugin/include/nccl/*.h)
	bash scripts/setup.sh $(VENV)
	touch $@

# The main job: the contention benchmark on the embedded local testbed (falls back to the
# simulator, and says so, without root or the needed kernel features).
demo: setup
	$(BIN)/flowsched bench contention --out results/contention

lint: setup
	$(BIN)/ruff check flowsched tests bench
	$(BIN)/ruff format --check flowsched tests bench

typecheck: setup
	$(BIN)/mypy

plugin: setup
	$(MAKE) -C nccl_plugin

plugin-test: setup
	$(MAKE) -C nccl_plugin check

# pytest exits 5 when it collected no test; make treats every non-zero status as a failure.
pytest: setup
	$(BIN)/python -m pytest -q

test: lint typecheck plugin-test pytest

clean:
	rm -rf $(VENV) build dist *.egg-info nccl_plugin/build flowsched/_plugin/*.so
