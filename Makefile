# Two entry points: `make demo` (the main job) and `make test`. Both set up .venv/ first if needed.
VENV := .venv
PY := $(VENV)/bin/python
# On machines without an NVIDIA GPU a CPU build of torch is installed first (fast, no CUDA download); with a GPU,
# pip resolves torch from pyproject.toml as usual.
TORCH_CPU := torch==2.13.0

.PHONY: setup demo test lint
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install --quiet $(TORCH_CPU); fi
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

demo: setup
	$(VENV)/bin/hf-diloco demo

test: setup
	$(PY) -m pytest

lint: setup
	$(VENV)/bin/ruff check .
