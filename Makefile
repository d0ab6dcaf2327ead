# The two commands: `make demo` and `make test`. Both create .venv if missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test test-slow bench setup clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch is installed first and alone: letting pip resolve it through the package's
# `torch>=2.6` could pull a multi-GB CUDA build. GPU users: see README.
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/python -m examples.demo

# two workers, each test file whole on one (its module fixtures run once): tracing and planning are
# single-threaded Python, so the 2 cores the suite is sized for are both kept busy
test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) build *.egg-info
