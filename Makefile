# Two entry points for a fresh machine; both set up .venv on first use.
#   make demo   train the demo models with eager and with backend="erase"
#   make test   run the test suite (CPU only)
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
# NB: pin torch before installing the package: a bare "torch" requirement
# would download a multi-GB CUDA build; 2.13.0's CPU wheel is on the CI disk.
TORCH ?= torch==2.13.0

.PHONY: demo test setup clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test,viz,paper]'
	touch $@

demo: setup
	$(PY) -m erase_fx.demo

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
