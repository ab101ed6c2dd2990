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
QUANTIZE := .cache/llama-quantize

.PHONY: install demo test test-gpu lint clean llama-cpp-converter llama-quantize

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

# llama.cpp's quantizer, built from the same release's source (CPU only; minutes on two cores): the tests
# of files it quantizes (tests/formats/test_llama_quantize.py) run where it is built and skip elsewhere
llama-quantize: $(QUANTIZE)/bin/llama-quantize

$(QUANTIZE)/bin/llama-quantize:
	@rm -rf $(QUANTIZE).tmp && mkdir -p $(QUANTIZE).tmp
	$(BIN)/python -m pip download -q --no-deps --no-binary :all: -d $(QUANTIZE).tmp "llama-cpp-python==$(LLAMA_CPP_PYTHON)"
	tar xzf $(QUANTIZE).tmp/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(QUANTIZE).tmp --strip-components=3 \
		llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp
	cmake -S $(QUANTIZE).tmp -B $(QUANTIZE).tmp/build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
		-DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
	cmake --build $(QUANTIZE).tmp/build --target llama-quantize -j >/dev/null
	mkdir -p $(QUANTIZE)/bin && cp $(QUANTIZE).tmp/build/bin/llama-quantize $(QUANTIZE)/bin/ && rm -rf $(QUANTIZE).tmp

test-gpu: install
	$(BIN)/python -m pytest -q -m gpu

lint: install
	$(BIN)/ruff check src tests benchmarks examples

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .cache
