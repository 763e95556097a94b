# `make demo` and `make test` each work on a fresh machine: both build the virtualenv they need.
# torch is pinned first: 2.13.0 is a CPU wheel; a looser pin would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-all bench docs clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/quickstart.py

test: $(VENV)/.installed
	$(PY) -m pytest -q

test-all: $(VENV)/.installed
	$(PY) -m pytest -q -m "slow or not slow"

# Each benchmark runs as a module from the repository root, where it imports `benchmarks` and
# `examples` as packages.
BENCHMARKS := $(sort $(basename $(notdir $(filter-out %/__init__.py,$(wildcard benchmarks/*.py)))))

bench: $(VENV)/.installed
	for b in $(BENCHMARKS); do echo "== benchmarks.$$b"; $(PY) -m benchmarks.$$b || exit 1; done

# The pages in docs/ and the API reference from the docstrings, into site/; warnings are errors.
$(VENV)/.docs-installed: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[docs]'
	touch $@

docs: $(VENV)/.docs-installed
	$(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis site
