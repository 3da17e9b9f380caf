# Two entry points (README): `make demo` runs the main job, `make test` runs the tests.
# Both create .venv and install what they need; on a CPU-only machine torch==2.13.0 is
# installed first so that pip never pulls a multi-GB CUDA build. The optional zoo extra
# (torchvision, timm, transformers: the CI-sized zoo tests) is installed with the torch
# already in .venv pinned (.venv/constraints.txt), so it never replaces that torch; so is the
# integrations extra (transformers, accelerate, peft, lightning: tests/test_examples.py).
# `make test-torch-next` runs the core suite on the newest torch the index serves, in .venv-torch-next
# (never part of `make test`: a large download).
# `make gpu-check` runs benchmarks/gpu_check.py and the cuda-marked tests on a GPU machine.
# `make zoo` runs remat receipt on every zoo model (benchmarks/zoo/run.py -> benchmarks/ZOO.md);
# `make compile-zoo` runs frontier --compile and verify --compile on each (benchmarks/compile_check.py --zoo).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.remat-installed
ZOO_STAMP := $(VENV)/.remat-zoo-installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

$(ZOO_STAMP): $(STAMP)
	$(BIN)/python -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/constraints.txt
	$(BIN)/python -m pip install -q -e '.[test,zoo,integrations]' -c $(VENV)/constraints.txt
	# only where PyPI's torchvision (a CUDA build) does not load beside this torch: an import hook, so a plain
	# script imports transformers, timm and torchvision (NOTE [torchvision import hook] in benchmarks/zoo/_torchvision_cpu.py)
	$(BIN)/python -c "import torchvision" 2>/dev/null || $(BIN)/python benchmarks/zoo/_torchvision_cpu.py --install
	$(BIN)/python -c "import torchvision, timm, transformers, diffusers, peft"
	touch $(ZOO_STAMP)

.PHONY: install demo test test-compile test-torch-next compile-zoo zoo zoo-extra gpu-check
install: $(STAMP)

demo: $(STAMP)
	$(BIN)/remat demo --out out/demo

# lint-imports: the [tool.importlinter] layers contract in pyproject.toml (docs/DESIGN.md's stage table).
# pytest-xdist runs TEST_WORKERS test files at once (--dist loadfile: a file's tests stay in order in one
# worker); serial pytest kept one of CI's two cores idle. TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2
test: $(ZOO_STAMP)
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

# the torch.compile tests the default run leaves out (a few minutes on 2 CPU cores)
test-compile: $(STAMP)
	TORCHINDUCTOR_COMPILE_THREADS=1 $(BIN)/python -m pytest -m compile tests

# the core suite against the newest torch the package index serves, in a venv of its own (.venv-torch-next),
# outside `make test`: it downloads that torch (from PyPI on Linux a multi-GB CUDA build). remat itself goes in
# with --no-deps (pyproject.toml declares only the torch versions that have run) and its other dependencies
# from pyproject.toml. What it found goes in benchmarks/RESULTS.md; docs/TORCH-NOTES.md "Supported torch".
NEXT_VENV := .venv-torch-next
CORE_TESTS := $(addprefix tests/test_,$(addsuffix .py,memory apply auto profile plan verify offload hazards \
	compile simulate distributed pipeline))
test-torch-next:
	$(PY) -m venv $(NEXT_VENV)
	$(NEXT_VENV)/bin/python -m pip install -q --upgrade pip
	$(NEXT_VENV)/bin/python -m pip install -q --upgrade torch
	$(NEXT_VENV)/bin/python -m pip install -q --no-deps -e .
	$(NEXT_VENV)/bin/python -m pip install -q $$($(NEXT_VENV)/bin/python -c "import tomllib; p = \
		tomllib.load(open('pyproject.toml', 'rb'))['project']; print(' '.join( \
		[d for d in p['dependencies'] if not d.startswith('torch')] + p['optional-dependencies']['test']))")
	$(NEXT_VENV)/bin/python -c "import torch; print('core suite on torch', torch.__version__)"
	$(NEXT_VENV)/bin/python -m pytest -rf $(CORE_TESTS)

# frontier --compile and verify --compile on every zoo model at a budget halfway between remat's floor
# and the control's peak (make zoo's rule; about 30 min on 2 CPU cores;
# benchmarks/results/compile_check_zoo.json and benchmarks/RESULTS.md "torch.compile on the zoo")
compile-zoo: $(ZOO_STAMP)
	TORCHINDUCTOR_COMPILE_THREADS=1 $(BIN)/python benchmarks/compile_check.py --zoo --budgets mid --tries 2 --steps 5

# every CUDA path on one GPU: benchmarks/results/gpu/*.json and a section of benchmarks/RESULTS.md
gpu-check: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py
	$(BIN)/python -m pytest -m cuda tests
	$(BIN)/python benchmarks/compile_check.py --device cuda --gpt2-small

zoo: $(ZOO_STAMP)
	$(BIN)/python benchmarks/zoo/run.py

# models the zoo was not written against (benchmarks/zoo/extra): benchmarks/ZOO-EXTRA.md
zoo-extra: $(ZOO_STAMP)
	$(BIN)/python benchmarks/zoo/run.py --extra benchmarks/zoo/extra --fast --out out/zoo-extra \
		--results benchmarks/zoo/extra/results.json --markdown benchmarks/ZOO-EXTRA.md
