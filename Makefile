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
# PyTorch pinned; an unpinned torch pulls gigabytes of CUDA packages. Where pip's own index serves the
# CUDA build for this pin too (PyPI's Linux wheel), `make TORCH_INDEX=https://download.pytorch.org/whl/cpu`
# takes PyTorch's CPU build from its own index. Left empty: CI's machines hold the CPU wheel locally.
TORCH  ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: install install-test demo multi30k test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
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

# bench/decode.py compares with transformers' generate and CTranslate2: the export extras.
$(VENV)/.installed-bench: $(VENV)/.installed
	$(PIP) -e '.[export,bench]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

# The main job: train a small de->en model on Multi30k for a few minutes, then translate with it.
# configs/demo.toml is chosen for five minutes on 2 cores (docs/demo.md); it validates when time is up.
DEMO_MINUTES ?= 4.5
DEMO_SENTENCES := "Ein Mann fährt mit dem Fahrrad eine Straße entlang." "Zwei Hunde spielen im Schnee." \
  "Eine Frau in einem roten Kleid singt auf einer Bühne." "Kinder spielen Fußball auf einer Wiese."
# The score of best/ (the model that translates), then each sentence beside its translation, padded by
# characters (printf pads by bytes: ä, ü, ß are two).
DEMO_SHOW := import sys, json; s, t = (open(f, encoding="utf-8").read().splitlines() for f in sys.argv[1:3]); \
  v = [r for r in map(json.loads, open(sys.argv[3])) if "bleu" in r]; best = max(v, key=lambda r: r["bleu"]); \
  print("runs/demo/best: validation BLEU {:.2f} (step {}); its translations:".format(best["bleu"], best["step"])); \
  w = max(map(len, s)); print("\n".join(f"  {a:<{w}}  ->  {b}" for a, b in zip(s, t)))
demo: install
	rm -rf runs/demo
	$(AIAYN) train --config configs/demo.toml --src de --tgt en --max-minutes $(DEMO_MINUTES) --out runs/demo
	printf '%s\n' $(DEMO_SENTENCES) > runs/demo/demo.de
	$(AIAYN) translate --checkpoint runs/demo --beam 4 < runs/demo/demo.de > runs/demo/demo.en
	@echo; $(PY) -c '$(DEMO_SHOW)' runs/demo/demo.de runs/demo/demo.en runs/demo/metrics.jsonl
	@echo; echo "Next:"
	@echo "  $(AIAYN) plot attention --checkpoint runs/demo --src 'Zwei Hunde spielen im Schnee.' -o runs/demo-attention.png"
	@echo "  $(AIAYN) plot curves --checkpoint runs/demo -o runs/demo-curves.png"
	@echo "  $(PY) -m pip install -e '.[serve]' && $(AIAYN) serve --checkpoint runs/demo   # then open http://127.0.0.1:8000/"
	@echo "  make multi30k   # the full recipe: an hour per direction (de->en, then en->de), scored on test_2016_flickr"

# Train de->en, then en->de, 60 minutes each on both cores; choose the average and beam/alpha on val; score test_2016_flickr.
multi30k: install
	AIAYN=$(AIAYN) bash bench/multi30k.sh de en 60 2
	AIAYN=$(AIAYN) bash bench/multi30k.sh en de 60 2

# The type checker first (settings: pyproject's [tool.mypy]), so a type error fails `make test`.
test: install-test
	$(PY) -m mypy
	$(PY) -m pytest -q

bench: $(VENV)/.installed-bench
	$(PY) bench/train_step.py
	$(PY) bench/decode.py

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache
