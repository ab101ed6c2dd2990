# FreeToken developer entry points. `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU machines get the CPU build of torch; machines with an NVIDIA driver keep pip's default build.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

# llama.cpp's own HF -> GGUF converter (a test oracle for the GGUF readers), from the llama-cpp-python
# source release that vendors it; tests that need it skip when it could not be had.
LLAMA_CPP_PYTHON ?= 0.3.36
CONVERTER := .cache/llama-cpp-converter

.PHONY: install demo test test-gpu lint clean llama-cpp-converter

$(BIN)/freetoken: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	@touch $@

install: $(BIN)/freetoken

demo: install
	$(BIN)/freetoken run --prompt "Tell me about mixture-of-experts models." --max-tokens 64 --seed 0

test: install
	-@$(MAKE) -s llama-cpp-converter
	$(BIN)/python -m pytest -q -m "not gpu"

llama-cpp-converter: $(CONVERTER)/convert_hf_to_gguf.py

$(CONVERTER)/convert_hf_to_gguf.py:
	@rm -rf $(CONVERTER).tmp && mkdir -p $(CONVERTER).tmp
	$(BIN)/python -m pip download -q --no-deps --no-binary :all: -d $(CONVERTER).tmp "llama-cpp-python==$(LLAMA_CPP_PYTHON)"
	tar xzf $(CONVERTER).tmp/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(CONVERTER).tmp --strip-components=3 \
		llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp/convert_hf_to_gguf.py \
		llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp/conversion \
		llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp/gguf-py
	rm -f $(CONVERTER).tmp/*.tar.gz && rm -rf $(CONVERTER) && mv $(CONVERTER).tmp $(CONVERTER)

test-gpu: install
	$(BIN)/python -m pytest -q -m gpu

lint: install
	$(BIN)/ruff check src tests benchmarks examples

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .cache
