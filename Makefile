# The two commands of the README: `sudo make test` and `sudo make bench`.
# Both run scripts/setup.sh first (idempotent: seconds when nothing changed).
# `sudo make vm-test` runs the VM tests that `make test` leaves out (qemu, ~2 min under TCG).
PY := .venv/bin/python
PYTEST_ARGS ?= -m "not vm"
BENCH_ARGS ?= all

.PHONY: help setup test vm-test bench doctor clean

# the first target: a bare `make` says what there is (it ran setup, which may apt-get install)
help:
	@echo "sudo make test      install what is missing (scripts/setup.sh), then the test suite (not the VM tests)"
	@echo "sudo make bench     the same setup, then every benchmark suite in full (python -m bench -h lists them)"
	@echo "sudo make vm-test   the VM tests: real NVMe-oF namespaces in a qemu guest (~2 min under TCG)"
	@echo "sudo make doctor    can this machine run the data path? one line a check"
	@echo "sudo make setup     only the setup (idempotent: seconds when nothing changed)"
	@echo "make clean          remove the venv and the built extensions"
	@echo "variables: PYTEST_ARGS (default: -m \"not vm\"), BENCH_ARGS (default: all), VM_PYTEST_ARGS"

setup:
	@scripts/setup.sh

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# qemu and busybox-static installed and the kernel package fetched first, so the vm tests are not skipped
vm-test: setup
	$(PY) -m datapath.vmtest --install-only
	$(PY) -m pytest -m vm -v -s $(VM_PYTEST_ARGS)

bench: setup
	$(PY) -m bench $(BENCH_ARGS)

doctor: setup
	.venv/bin/datapath doctor

clean:
	rm -rf .venv build *.egg-info datapath/*.so .pytest_cache .hypothesis
