# The README's commands. Each creates and reuses .venv and installs what it needs; without an
# NVIDIA GPU it installs the CPU build of torch, so no multi-GB CUDA build is downloaded.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
GPUS := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
# tp=2 pp=2 dp=2 on 8 CPU processes, or the GPUs when present (tp=1 pp=1 on fewer than 4)
ifeq ($(GPUS),0)
  NPROC ?= 8
  LAYOUT ?= --tp 2 --pp 2
else ifeq ($(shell test $(GPUS) -ge 4 && echo big),big)
  NPROC ?= $(shell echo $$(( $(GPUS) / 4 * 4 )))
  LAYOUT ?= --tp 2 --pp 2
else
  NPROC ?= 1
  LAYOUT ?= --tp 1 --pp 1
endif
TORCH_CPU := torch==2.13.0
# The compatibility stage: the newest torch a GPU user gets (its CUDA build, which runs on a CPU
# too, and the triton it pins) in a second venv; README "Supported versions".
VENV_NEW ?= .venv-new
TORCH_NEW := torch==2.14.1
STAMP_NEW := $(VENV_NEW)/.installed
# (the sm_100a attention sweep, 4 minutes here, is left to make test: it adds an arch, not a version)
COMPAT_TESTS := tests/kernels tests/unit/test_torch_version.py tests/unit/test_run_settings.py \
  "tests/e2e/test_layouts.py::test_layout_matches_one_process[tp2-pp2]" \
  --deselect tests/kernels/test_aot.py::test_window_and_mla_attention_compile_on_sm_100a

.PHONY: install train test test-full test-fast test-compat lint format bench clean

install: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	if [ "$(GPUS)" = "0" ]; then $(PY) -m pip install -q "$(TORCH_CPU)"; fi
	$(PY) -m pip install -q -e '.[test,lint]'
	touch $(STAMP)

train: $(STAMP)
	rm -rf checkpoints/tiny runs/tiny  # the demo starts afresh each time
	$(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) pretrain_gpt.py \
	  --config configs/tiny.yaml $(LAYOUT) --save checkpoints/tiny \
	  --metrics-file runs/tiny/metrics.jsonl $(ARGS)
	$(PY) tools/generate.py --load checkpoints/tiny --prompt "def main(" --max-new-tokens 48 --temperature 0.8 --top-k 40 --seed 1

# make test leaves out the parity-sweep cases marked `full` (their code paths are run by the
# representative cases); make test-full runs everything.
test: $(STAMP)
	$(PY) -m pytest -q tests -m "not full" $(ARGS)

test-full: $(STAMP)
	$(PY) -m pytest -q tests $(ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q tests -m "not slow and not full" $(ARGS)

$(STAMP_NEW): setup.py
	test -x $(VENV_NEW)/bin/python || python3 -m venv $(VENV_NEW)
	$(VENV_NEW)/bin/python -m pip install -q "$(TORCH_NEW)"
	$(VENV_NEW)/bin/python -m pip install -q -e '.[test]'
	touch $(STAMP_NEW)

# Kernel tests under the interpreter, the ahead-of-time kernel check (tests/kernels/test_aot.py)
# under that torch's triton, and one small distributed run against one process.
test-compat: $(STAMP_NEW)
	$(VENV_NEW)/bin/python -c "import torch, triton; print('compat:', torch.__version__, 'triton', triton.__version__)"
	$(VENV_NEW)/bin/python -m pytest -q $(COMPAT_TESTS) $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: $(STAMP)
	$(PY) bench/run_all.py

clean:
	rm -rf checkpoints runs wandb
