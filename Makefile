# Quick start: `make run` (embedded demo) and `make test` (the test suite).
# Both create .venv when missing and install what they need; a stamp file makes
# repeated runs skip the install unless pyproject.toml changed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch is pinned here (not in pyproject) so pip takes the CPU wheel on this machine
# instead of resolving a multi-GB CUDA build; pyproject accepts any torch in range.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.adaptspec-installed
TEST_STAMP := $(VENV)/.adaptspec-test-installed

.PHONY: run test install protos bench clean-venv deploy-check mutation-check gpu-check

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PIP) show torch >/dev/null 2>&1 || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e .
	touch $(STAMP)

# tests add pytest/scipy and Triton (about 1 GB; its kernels are tested on the CPU interpreter)
$(TEST_STAMP): $(STAMP)
	$(PIP) install -q -e ".[test,triton]"
	touch $(TEST_STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/adaptspec demo

# Unit and statistical tests run on every core (pytest-xdist, a file to a worker, one torch/OpenMP
# thread each: most are single-threaded Python or small tensors); the integration tests then run
# alone, each module's Ray cluster given the whole machine. Both parts always run; the target
# fails if either did. --durations: the slowest tests, so a suite creeping past its 15 minutes
# on 2 cores shows where. TEST_WORKERS=1 runs everything in one process.
TEST_WORKERS ?= auto
PYTEST_PAR := $(if $(filter 1,$(TEST_WORKERS)),,OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --maxprocesses 4 --dist loadfile)
test: $(TEST_STAMP)
	$(VENV)/bin/adaptspec models pull smollm2-135m
	@rc=0; \
	$(or $(PYTEST_PAR),$(PY) -m pytest) -q --durations=20 tests/unit tests/statistical || rc=$$?; \
	$(PY) -m pytest -q --durations=10 tests/integration || rc=$$?; \
	exit $$rc

bench: $(STAMP)
	$(VENV)/bin/adaptspec bench

# plant each known bug of tests/mutation/mutations.toml in a copy of the tree and check the
# tests meant to catch it fail (not part of `make test`; run it before resolving engine work)
mutation-check: $(TEST_STAMP)
	$(PY) tests/mutation/run.py

# the GPU check (issue #23): the CUDA test subset and a speed table on a random-weight
# 8B-shaped model, one JSON to $OUT/ (when set) or docs/results/gpu-check-DATE.json. No install
# step: it runs on a CUDA machine with only torch + triton (pytest, transformers when there),
# with this venv's python where one exists, else $(PYTHON). docs/benchmarks.md#gpu-check
GPU_CHECK_PY ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:
	$(GPU_CHECK_PY) -m adaptspec.tools.gpu_check $(GPU_CHECK_ARGS)

# render the Kubernetes profiles (deploy/profiles) and validate every generated object
deploy-check: $(TEST_STAMP)
	$(PY) -m adaptspec.serve.deploy --check

protos: $(TEST_STAMP)  # grpcio-tools comes with the test extra
	$(PY) -m adaptspec.serve.protogen

clean-venv:
	rm -rf $(VENV)
