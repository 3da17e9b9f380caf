# Two entry points (README): `make demo` runs the main job, `make test` runs the tests.
# Both create .venv and install what they need; on a CPU-only machine torch==2.13.0 is
# installed first so that pip never pulls a multi-GB CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.remat-installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

.PHONY: install demo test
install: $(STAMP)

demo: $(STAMP)
	$(BIN)/remat demo --out out/demo

test: $(STAMP)
	$(BIN)/python -m pytest
