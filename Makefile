# FreeToken developer entry points. `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU machines get the CPU build of torch; machines with an NVIDIA driver keep pip's default build.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

.PHONY: install demo test test-gpu lint clean

$(BIN)/freetoken: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	@touch $@

install: $(BIN)/freetoken

demo: install
	$(BIN)/freetoken run --prompt "Tell me about mixture-of-experts models." --max-tokens 64 --seed 0

test: install
	$(BIN)/python -m pytest -q -m "not gpu"

test-gpu: install
	$(BIN)/python -m pytest -q -m gpu

lint: install
	$(BIN)/ruff check src tests benchmarks examples

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
