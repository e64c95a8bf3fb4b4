# make demo: the offline quickstart training.  make test: the test suite.
# Both create or update .venv from nothing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-slow bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m rayspec.train

test: $(STAMP)
	$(PY) -m pytest

test-slow: $(STAMP)
	$(PY) -m pytest -m slow

# Every benchmark at full size (tens of minutes on 2 cores); each writes benchmarks/results/NAME.json.
BENCHMARKS := overhead stage_cost efficiency partition communication memory p2p_memory throughput peer hops recovery driver probe plots
bench: $(STAMP)
	for b in $(BENCHMARKS); do $(PY) -m benchmarks.$$b || exit 1; done

clean:
	rm -rf $(VENV) outputs multirun
