# `make test` and `make demo` build the virtual environment from requirements.txt on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: test venv demo clean-venv

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	touch $@

test: venv
	$(PY) -m pytest -q tests

clean-venv:
	rm -rf $(VENV)
