# The two commands of the README: `sudo make test` and `sudo make bench`.
# Both run scripts/setup.sh first (idempotent: seconds when nothing changed).
PY := .venv/bin/python
PYTEST_ARGS ?= -m "not vm"
BENCH_ARGS ?= all

.PHONY: setup test bench doctor clean

setup:
	@scripts/setup.sh

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

bench: setup
	$(PY) -m bench $(BENCH_ARGS)

doctor: setup
	.venv/bin/datapath doctor

clean:
	rm -rf .venv build *.egg-info datapath/*.so .pytest_cache .hypothesis
