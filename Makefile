# The two quickstart commands: `make serve` and `make test`.
# Both create .venv on first use; only Python (3.11, or 3.12/3.13), pip and make are needed.
# Installs use the exact versions in constraints.txt (torch above all: see that file).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
CONSTRAINTS := constraints.txt
CLI    := $(VENV)/bin/dspark-core
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: serve test wheel-check docs clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Reinstall only when the packaging files change.
$(VENV)/.installed: pyproject.toml setup.py $(CONSTRAINTS) | $(PY)
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[dev]'
	touch $@

test: $(VENV)/.installed
	$(PY) -m pytest -q

serve: $(VENV)/.installed
	$(CLI) fetch-model smollm2
	$(CLI) serve --model=smollm2 --draft_model=default --host=$(HOST) --port=$(PORT) \
	  --num_speculative_tokens=7 --enable_adaptive_speculative_decode=true \
	  --captured_target_rows=bucket_multiples --max_model_len=2048 \
	  --adaptive_dspark_calibration=demo

# Build the sdist and wheel, install the wheel in a fresh venv outside the repository and
# generate + serve from there (CI runs it after `make test`; a few minutes).
wheel-check: $(VENV)/.installed
	PYTHON=$(PYTHON) .ci/wheel-check

docs: $(VENV)/.installed
	$(PY) -m dspark_core.docgen > docs/cli.md

clean-venv:
	rm -rf $(VENV)
