# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check
AIAYN  := $(VENV)/bin/aiayn
# Multi30k is read from $AIAYN_DATA, else a copy beside the checkout, else downloaded once (sha256-checked).
ifneq ($(wildcard ../shared/data/multi30k),)
export AIAYN_DATA ?= $(abspath ../shared/data)
endif
# The CPU build of PyTorch; an unpinned torch pulls gigabytes of CUDA packages.
TORCH  ?= torch==2.13.0

.PHONY: install install-test demo multi30k test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) $(TORCH)
	$(PIP) -e .
	touch $@

# transformers 5 removed pipeline("translation"); the export test runs it with 4.x from its own folder,
# first on PYTHONPATH in a subprocess, so the venv keeps transformers 5 (tests/hf4-requirements.txt).
$(VENV)/.installed-hf4: $(VENV)/.installed tests/hf4-requirements.txt
	rm -rf $(VENV)/hf4
	$(PIP) --no-deps --target $(VENV)/hf4 -r tests/hf4-requirements.txt
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed $(VENV)/.installed-hf4
	$(PIP) -e '.[test,export,serve]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

# The main job: train a small de->en model on Multi30k for a few minutes, then translate with it.
DEMO_MINUTES ?= 5
# Shown on stderr with `>&2`, which shares the descriptor: `tee /dev/stderr` reopened the file that
# `make demo > demo.log 2>&1` writes to and truncated the training log.
DEMO_SENTENCES := "Ein Mann fährt mit dem Fahrrad eine Straße entlang." "Zwei Hunde spielen im Schnee." \
  "Eine Frau in einem roten Kleid singt auf einer Bühne." "Kinder spielen Fußball auf einer Wiese."
demo: install
	rm -rf runs/demo
	$(AIAYN) train --config configs/multi30k.toml --src de --tgt en --max-minutes $(DEMO_MINUTES) \
	  --valid-bleu 200 --out runs/demo
	printf '%s\n' $(DEMO_SENTENCES) >&2
	printf '%s\n' $(DEMO_SENTENCES) | $(AIAYN) translate --checkpoint runs/demo --beam 4

# Train de->en, then en->de, 60 minutes each on both cores; choose the average and beam/alpha on val; score test_2016_flickr.
multi30k: install
	AIAYN=$(AIAYN) bash bench/multi30k.sh de en 60 2
	AIAYN=$(AIAYN) bash bench/multi30k.sh en de 60 2

test: install-test
	$(PY) -m pytest -q

bench: install
	$(PY) bench/train_step.py
	$(PY) bench/decode.py

clean:
	rm -rf $(VENV) runs .pytest_cache
