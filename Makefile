# The two commands of the README: `sudo make test` and `sudo make bench`.
# Both run scripts/setup.sh first (idempotent: seconds when nothing changed).
# `sudo make vm-test` runs the VM tests that `make test` leaves out (qemu, ~2 min under TCG).
PY := .venv/bin/python
PYTEST_ARGS ?= -m "not vm"
BENCH_ARGS ?= all

.PHONY: setup test vm-test bench doctor clean

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
