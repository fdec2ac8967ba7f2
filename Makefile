# labkit: `make lab` runs the lab, `make test` runs the tests (see README.md).
#
#   make venv       .venv with torch (CPU, installed first), requirements.txt and labkit (editable)
#   make models     download, verify and convert the embedded model pair once (~/.cache/labkit)
#   make lab        JupyterLab on notebooks/00_tour.ipynb, notebooks trusted first (LAB_PORT=8888, LAB_IP=127.0.0.1, LAB_REMOTE=1)
#   make book       the notebooks with their stored outputs as a static site: build/book/index.html, offline
#   make test       unit + integration tests and every notebook under strict nbval
#   make test-fast  unit tier only: tiny random models, no download
#   make bench      python -m labkit bench: every method on data/questions/, the embedded pair
#   make llama-cpp  optional peer: build llama.cpp's llama-bench and llama-speculative-simple (~20 min)
#   make llama-cpp-src  llama.cpp's source only: its converter writes `export --format llama-cpp` (~1 min)
#   make peers      optional peer: speculators (vLLM's EAGLE-3) checks the EAGLE-3 head, in .peers-venv (~3 min)
#   make arctic     optional peer: Arctic Inference's suffix tree (Snowflake's suffix decoding), built here (~1 min)
#   make gpu-check  on a CUDA machine, offline: CUDA tests + compiled speculation timed (< 8 min, data/bench/gpu_spec.*)

SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# torch goes in first and on its own: installed after its dependants, pip would fetch CUDA builds.
TORCH_VERSION := 2.13.0
VENV_STAMP    := $(VENV)/.labkit-installed
LAB_SETTINGS  := $(VENV)/share/jupyter/lab/settings

# read by python -m labkit lab itself (defaults 8888, 127.0.0.1; LAB_REMOTE=1 allows an address others reach)
export LAB_PORT LAB_IP LAB_REMOTE

PYTEST_NOTEBOOKS := tests notebooks --nbval --nbval-current-env --nbval-cell-timeout=900 --durations=25 \
                    --nbval-sanitize-with notebooks/sanitize.cfg

.PHONY: help venv models lab book test test-fast bench chromium gpu-check

help:
	@sed -n '2,15p' Makefile | sed 's/^# \{0,1\}//'

venv: $(VENV_STAMP)

$(VENV_STAMP): requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install torch==$(TORCH_VERSION)
	$(PIP) install -r requirements.txt
	$(PIP) install -e . --no-deps
	mkdir -p $(LAB_SETTINGS)
	echo '{"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": false}}' \
	    > $(LAB_SETTINGS)/overrides.json
	touch $@

models: venv
	$(PY) -m labkit fetch

# python -m labkit lab trusts notebooks/*.ipynb first (as `jupyter trust`): their saved widgets are drawn, not text
lab: venv models
	@exec $(PY) -m labkit lab

# the notebooks with their stored outputs as a static site: open build/book/index.html (no kernel, no network)
book: venv
	$(PY) -m labkit book

# two passes: the tests that may share the machine on two workers, one thread each (tiny models gain nothing from
# threads), then alone the real models, the notebooks and the tests that bound a measured time (tests/conftest.py)
test: venv models chromium
	LABKIT_TIER=parallel OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 tests --durations=25
	LABKIT_TIER=serial LABKIT_INTEGRATION=1 $(PY) -m pytest $(PYTEST_NOTEBOOKS)

# Debian's Chromium for tests/test_browser.py, installed once (as root, or with sudo). Without apt the browser
# test skips, except in CI (CI=true), where it must run.
chromium:
	@command -v chromium >/dev/null || test -x /usr/bin/chromium || { \
	    install="apt-get install -y --no-install-recommends chromium"; \
	    if ! command -v apt-get >/dev/null; then \
	        echo "no apt-get here: install Chromium at /usr/bin/chromium for the browser test (it skips without)" >&2; \
	        test "$$CI" != true; \
	    elif [ "$$(id -u)" = 0 ]; then \
	        apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$install; \
	    elif command -v sudo >/dev/null; then \
	        sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive $$install; \
	    else \
	        echo "error: the browser test needs Debian's chromium: run 'apt-get install chromium' as root" >&2; exit 1; \
	    fi; }

test-fast: venv
	LABKIT_TIER=parallel OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 tests
	LABKIT_TIER=serial $(PY) -m pytest tests

bench: venv models
	$(PY) -m labkit bench --questions data/questions/labkit_bench.jsonl --out data/bench/labkit_bench

# the GPU machine's own python3 (CUDA torch), not .venv; nothing is downloaded. GPU_PY=... to name another
GPU_PY ?= python3
gpu-check:
	PYTHONPATH=. PYTHONUNBUFFERED=1 $(GPU_PY) scripts/gpu_check.py


# Multi-token prediction: retrain the byte-level models of data/mtp/, then re-measure
# the loss memory and the comparison table. The 600-step fp32 configs take 15-29 min each on one core
# here (the 10-layer-trunk *_t10 ones ~44 min); the 300-step bf16-autocast ones 9-18 min where the CPU
# has native bf16, ~10x that on AVX2 only.
MTP_MODELS := next gloeckle4 deepseek3 gloeckle8 gloeckle4_w01 next_600 gloeckle4_600 gloeckle4_w01_600 deepseek3_600 next_988 next_1041 \
              gloeckle4_w01_600_t10 gloeckle4_w005_600_t10 next_778_t10
.PHONY: train-mtp
train-mtp: venv
	for m in $(MTP_MODELS); do $(PY) -m labkit.training.train_mtp --config data/mtp/configs/$$m.json --out data/mtp || exit 1; done
	$(PY) scripts/mtp_memory.py
	$(PY) scripts/mtp_results.py

# The hardware view (notebooks/08_hardware.ipynb): verify-time curve + roofline, batch sweep.
.PHONY: bench-hw
bench-hw: venv models
	nice -n 10 $(PY) scripts/roofline.py --threads 1 --cpu-time
	nice -n 10 $(PY) scripts/bench_batch.py --threads 1 --cpu-time

# speculators (vLLM's EAGLE-3 format and trainer) as a peer of the EAGLE-3 heads: its own Eagle3DraftModel loads
# the exported head and drafts on the same features (python -m labkit.export.peers; tests/test_peers.py). In its own
# environment, .peers-venv (speculators caps transformers below .venv's); about 3 minutes to build. Never part of
# `make test`; the record is data/bench/peers/.
PEERS_VENV := .peers-venv
.PHONY: peers
peers: venv models $(PEERS_VENV)/.installed
	LABKIT_PEERS_PYTHON=$(PEERS_VENV)/bin/python $(PY) -m pytest -q -p no:cacheprovider tests/test_peers.py
	$(PY) -m labkit.export.peers --python $(PEERS_VENV)/bin/python --out data/bench/peers

$(PEERS_VENV)/.installed: requirements-peers.txt
	python3 -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -r requirements-peers.txt
	$(PEERS_VENV)/bin/pip uninstall -y torchvision torchaudio
	touch $@

# llama.cpp as an optional peer of the benchmark (method `llama-cpp`, `--peer-bin`): the llama.cpp
# source vendored in the llama-cpp-python sdist on PyPI, built for this CPU (-DGGML_NATIVE=ON),
# Release, CPU only; build/llama.cpp/bin/ gets llama-bench, llama-completion and llama-speculative-simple.
# About 20 minutes on 2 cores. Never part of `make test`.
LLAMA_CPP_PY  := 0.3.36
LLAMA_CPP_DIR := build/llama.cpp
# ggml's AMX kernels (its repacked weights on CPUs with AMX) crash on any batch of 2+ tokens on the Intel
# Xeon with AMX we measured on (SIGSEGV in ggml_backend_amx_mul_mat); without them ggml uses its AVX-512 repack.
LLAMA_CPP_NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
.PHONY: llama-cpp
LLAMA_CPP_BINS := llama-bench llama-completion llama-speculative-simple
llama-cpp: $(LLAMA_CPP_DIR)/bin/.built

# the source alone (a minute): its convert_hf_to_gguf.py writes `python -m labkit export --format llama-cpp`
.PHONY: llama-cpp-src
llama-cpp-src: $(LLAMA_CPP_DIR)/src/.qwen2-tap

$(LLAMA_CPP_DIR)/src/CMakeLists.txt: | venv
	mkdir -p $(LLAMA_CPP_DIR)
	test -f $(LLAMA_CPP_DIR)/src/CMakeLists.txt || { \
	    $(PIP) download --no-deps --no-binary :all: -d $(LLAMA_CPP_DIR) llama-cpp-python==$(LLAMA_CPP_PY) && \
	    tar -xzf $(LLAMA_CPP_DIR)/llama_cpp_python-$(LLAMA_CPP_PY).tar.gz -C $(LLAMA_CPP_DIR) && \
	    rm -rf $(LLAMA_CPP_DIR)/src && \
	    mv $(LLAMA_CPP_DIR)/llama_cpp_python-$(LLAMA_CPP_PY)/vendor/llama.cpp $(LLAMA_CPP_DIR)/src && \
	    rm -rf $(LLAMA_CPP_DIR)/llama_cpp_python-$(LLAMA_CPP_PY); }

# llama.cpp's draft-eagle3 reads the target's layer inputs, which its Llama and Qwen3 graphs hand over and its
# Qwen2 graph does not (the run aborts: "layer input tensor is null"); one line in the Qwen2 graph adds the same
# tap as theirs, and nothing else changes (llama-completion's and draft-simple's outputs stay the same).
LLAMA_CPP_QWEN2 := $(LLAMA_CPP_DIR)/src/src/models/qwen2.cpp
$(LLAMA_CPP_DIR)/src/.qwen2-tap: $(LLAMA_CPP_DIR)/src/CMakeLists.txt
	grep -q 't_layer_inp' $(LLAMA_CPP_QWEN2) || sed -i 's|^    for (int il = 0; il < n_layer; ++il) {$$|&\n        res->t_layer_inp[il] = inpL;   // labkit: the layer inputs draft-eagle3 reads|' $(LLAMA_CPP_QWEN2)
	grep -q 't_layer_inp' $(LLAMA_CPP_QWEN2) || { echo "$(LLAMA_CPP_QWEN2): no layer loop found to tap"; exit 1; }
	touch $@

$(LLAMA_CPP_DIR)/bin/.built: $(LLAMA_CPP_DIR)/src/.qwen2-tap
	cmake -S $(LLAMA_CPP_DIR)/src -B $(LLAMA_CPP_DIR)/cmake -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
	    -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF \
	    -DCMAKE_C_FLAGS="$(LLAMA_CPP_NO_AMX)" -DCMAKE_CXX_FLAGS="$(LLAMA_CPP_NO_AMX)"
	cmake --build $(LLAMA_CPP_DIR)/cmake -j$$(nproc) --target $(LLAMA_CPP_BINS)
	mkdir -p $(LLAMA_CPP_DIR)/bin
	cp $(addprefix $(LLAMA_CPP_DIR)/cmake/bin/,$(LLAMA_CPP_BINS)) $(LLAMA_CPP_DIR)/bin/
	touch $@

# Arctic Inference's suffix decoding as a peer of labkit's suffix drafter (bench method `arctic-suffix`,
# python -m labkit.bench.arctic): the sdist of arctic-inference 0.3.0 from PyPI (checked against its sha256),
# of which only the suffix tree is built: its C++ extension (nanobind, for .venv's Python) beside its
# SuffixDecodingCache, in build/arctic/pkg. No torch, no CUDA, about a minute. Never part of `make test`.
ARCTIC_VERSION := 0.3.0
ARCTIC_SHA256  := 7f22e3e1b1071c6061c0d6951be17c0fb50b08d06d6e543144c8f52faba60a36
ARCTIC_URL     := https://files.pythonhosted.org/packages/63/c1/573fa2f00097cd9cc1167b31fd900b2482f58f3491867cebdd5516626533/arctic_inference-$(ARCTIC_VERSION).tar.gz
ARCTIC_DIR     := build/arctic
ARCTIC_SRC     := $(ARCTIC_DIR)/arctic_inference-$(ARCTIC_VERSION)
ARCTIC_PKG     := $(ARCTIC_DIR)/pkg/arctic_inference
.PHONY: arctic
arctic: $(ARCTIC_PKG)/.built

$(ARCTIC_PKG)/.built: | venv
	mkdir -p $(ARCTIC_DIR)
	test -f $(ARCTIC_DIR)/arctic.tar.gz || curl -sSfL -o $(ARCTIC_DIR)/arctic.tar.gz $(ARCTIC_URL)
	echo "$(ARCTIC_SHA256)  $(ARCTIC_DIR)/arctic.tar.gz" | sha256sum -c -
	tar -xzf $(ARCTIC_DIR)/arctic.tar.gz -C $(ARCTIC_DIR)
	$(PIP) install -q --target $(ARCTIC_DIR)/nanobind nanobind==2.9.2
	PYTHONPATH=$(ARCTIC_DIR)/nanobind cmake -S $(ARCTIC_SRC)/csrc/suffix_decoding -B $(ARCTIC_DIR)/cmake \
	    -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE=$(abspath $(PY))
	PYTHONPATH=$(ARCTIC_DIR)/nanobind cmake --build $(ARCTIC_DIR)/cmake -j$$(nproc)
	mkdir -p $(ARCTIC_PKG)/suffix_decoding
	cp $(ARCTIC_SRC)/arctic_inference/__init__.py $(ARCTIC_PKG)/
	cp $(ARCTIC_SRC)/arctic_inference/suffix_decoding/__init__.py $(ARCTIC_SRC)/arctic_inference/suffix_decoding/cache.py \
	    $(ARCTIC_DIR)/cmake/_C*.so $(ARCTIC_PKG)/suffix_decoding/
	touch $@
