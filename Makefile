# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check
# The CPU build of PyTorch; an unpinned torch pulls gigabytes of CUDA packages.
TORCH  ?= torch==2.13.0

.PHONY: install install-test demo test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) $(TORCH)
	$(PIP) -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) -e '.[test,export]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: install
	$(VENV)/bin/aiayn demo

test: install-test
	$(PY) -m pytest -q

bench: install
	$(PY) bench/train_step.py

clean:
	rm -rf $(VENV) runs .pytest_cache
