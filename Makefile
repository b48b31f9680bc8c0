# `make run` and `make test` set everything up on a fresh machine (see README.md).

VENV := .venv
BIN := $(VENV)/bin
# CPython 3.11: the only Python the local CPU torch wheel is built for.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
# Pinned: this version is a local CPU wheel; any other torch request pulls a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: venv test lint run clean

venv: $(VENV)/.installed

$(BIN)/python:
	@$(PYTHON) -c 'import sys; v = sys.version_info; ok = sys.implementation.name == "cpython" and v[:2] == (3, 11); sys.exit(0 if ok else f"need CPython 3.11 for the torch wheel, {sys.executable} is {sys.version}")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Re-run when pyproject.toml changes. torch first, so `-e .` finds it satisfied. Never install
# flash-linear-attention: transformers would use its kernels instead of the reference path.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	if ! nvidia-smi >/dev/null 2>&1; then $(BIN)/python -m pip install -q '$(TORCH)'; fi
	$(BIN)/python -m pip install -q -e '.[test,cluster]'
	@if $(BIN)/python -m pip show -q flash-linear-attention 2>/dev/null; then \
		echo "flash-linear-attention is installed in $(VENV): remove it (the tests need transformers' reference path)"; exit 1; fi
	touch $@

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The C++ decode kernels are built here (cached per source and CPU), so a failed build fails the tests.
test: lint
	$(BIN)/python -c 'import sys; from hybridkv.ops import native; sys.exit(native.main())'
	$(BIN)/pytest -q

run: venv
	$(BIN)/hybridkv generate "The function returns" --max-tokens 40

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
