# labkit: `make lab` runs the lab, `make test` runs the tests (see README.md).
#
#   make venv       .venv with torch (CPU, installed first), requirements.txt and labkit (editable)
#   make models     download, verify and convert the embedded model pair once (~/.cache/labkit)
#   make lab        JupyterLab on notebooks/00_tour.ipynb (LAB_PORT=8888, LAB_IP=127.0.0.1)
#   make test       unit + integration tests and every notebook under strict nbval
#   make test-fast  unit tier only: tiny random models, no download
#   make bench      python -m labkit bench: every method on data/questions/, the embedded pair

SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# torch goes in first and on its own: installed after its dependants, pip would fetch CUDA builds.
TORCH_VERSION := 2.13.0
VENV_STAMP    := $(VENV)/.labkit-installed
LAB_SETTINGS  := $(VENV)/share/jupyter/lab/settings

LAB_PORT ?= 8888
LAB_IP   ?= 127.0.0.1

PYTEST_NOTEBOOKS := tests notebooks --nbval --nbval-current-env --nbval-cell-timeout=900 --durations=25 \
                    --nbval-sanitize-with notebooks/sanitize.cfg

.PHONY: help venv models lab test test-fast bench chromium

help:
	@sed -n '2,9p' Makefile | sed 's/^# \{0,1\}//'

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

lab: venv models
	@token="$${LAB_TOKEN:-$$($(PY) -c 'import secrets; print(secrets.token_hex(24))')}"; \
	root_flag=""; if [ "$$(id -u)" = 0 ]; then root_flag="--allow-root"; fi; \
	echo; \
	echo "  labkit is starting. Open this URL in a browser (Ctrl-C here stops the lab):"; \
	echo; \
	echo "      http://$(LAB_IP):$(LAB_PORT)/lab/tree/notebooks/00_tour.ipynb?token=$$token"; \
	echo; \
	exec $(VENV)/bin/jupyter lab --no-browser $$root_flag --ServerApp.root_dir="$(CURDIR)" \
	    --LabApp.default_url=/lab/tree/notebooks/00_tour.ipynb \
	    --ServerApp.ip=$(LAB_IP) --ServerApp.port=$(LAB_PORT) --ServerApp.port_retries=0 \
	    --IdentityProvider.token="$$token"

test: venv models chromium
	LABKIT_INTEGRATION=1 $(PY) -m pytest $(PYTEST_NOTEBOOKS)

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
	$(PY) -m pytest tests

bench: venv models
	$(PY) -m labkit bench --questions data/questions/labkit_bench.jsonl --out data/bench/labkit_bench


# Multi-token prediction (issue 4): retrain the byte-level models of data/mtp/, then re-measure
# the loss memory and the comparison table. The 600-step fp32 configs take 15-29 min each on one core
# here (the 10-layer-trunk *_t10 ones ~44 min); the 300-step bf16-autocast ones 9-18 min where the CPU
# has native bf16, ~10x that on AVX2 only.
MTP_MODELS := next gloeckle4 deepseek3 gloeckle8 gloeckle4_w01 next_600 gloeckle4_600 gloeckle4_w01_600 deepseek3_600 next_988 next_1041 \
              gloeckle4_w01_600_t10 gloeckle4_w005_600_t10 next_778_t10
.PHONY: train-mtp
train-mtp: venv
	for m in $(MTP_MODELS); do $(PY) -m labkit.mtp.train --config data/mtp/configs/$$m.json --out data/mtp || exit 1; done
	$(PY) scripts/mtp_memory.py
	$(PY) scripts/mtp_results.py

# The hardware view (notebooks/08_hardware.ipynb): verify-time curve + roofline, batch sweep.
.PHONY: bench-hw
bench-hw: venv models
	nice -n 10 $(PY) scripts/roofline.py --threads 1 --cpu-time
	nice -n 10 $(PY) scripts/bench_batch.py --threads 1 --cpu-time
