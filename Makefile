# Two entry points for a fresh machine; both set up .venv on first use.
#   make demo   train the demo models with eager and with backend="erase"
#   make test   run the test suite (CPU only)
#   make test-all  the same, with the slow tests (long Inductor compiles)
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
# torch: a compatible one that $(PYTHON) already has (a GPU machine's) is used
# as it is, through a venv that sees the system's packages; otherwise the CPU
# build of TORCH is installed: TORCH+cpu from the indexes pip is configured
# with (local wheels, a mirror) when they hold it, else from PyTorch's CPU
# index. NB: never a bare "torch" from PyPI, which is a multi-GB CUDA build.
TORCH ?= torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
HAS_TORCH := $(shell $(PYTHON) -c "import torch, sys; v = tuple(int(p) for p in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(0 if (2, 11) <= v <= (2, 15) else 1)" 2>/dev/null && echo yes)

.PHONY: demo test test-all setup clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
ifeq ($(HAS_TORCH),yes)
	@echo "using the torch $(PYTHON) has: $$($(PYTHON) -c 'import torch; print(torch.__version__)')"
	$(PYTHON) -m venv --system-site-packages $(VENV)
else
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)+cpu" 2>/dev/null || \
	  $(PY) -m pip install -q $(TORCH) --index-url $(TORCH_CPU_INDEX)
endif
	$(PY) -m pip install -q -e '.[test,viz,paper]'
	touch $@

demo: setup
	$(PY) -m erase_fx.demo

test: setup
	$(PY) -m pytest -q

test-all: setup
	$(PY) -m pytest -q -m ""

clean:
	rm -rf $(VENV) build *.egg-info
