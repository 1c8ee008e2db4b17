# The two quickstart commands: `make serve` and `make test`.
# Both create .venv on first use; only Python 3.11, pip and make are needed.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
CLI    := $(VENV)/bin/dspark-core
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: serve test docs clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Reinstall only when the packaging files change.
$(VENV)/.installed: pyproject.toml setup.py | $(PY)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

test: $(VENV)/.installed
	$(PY) -m pytest -q

serve: $(VENV)/.installed
	$(CLI) fetch-model smollm2
	$(CLI) serve --model=smollm2 --draft_model=default --host=$(HOST) --port=$(PORT) \
	  --num_speculative_tokens=7 --enable_adaptive_speculative_decode=true \
	  --captured_target_rows=bucket_multiples --max_model_len=2048 \
	  --adaptive_dspark_calibration=configs/demo-calibration.json

docs: $(VENV)/.installed
	$(PY) -m dspark_core.docgen > docs/cli.md

clean-venv:
	rm -rf $(VENV)
