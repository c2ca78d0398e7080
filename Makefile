# Two commands do everything on a fresh Debian/Ubuntu machine (as root):
#   make demo   the whole story on one machine (the engine extra; no PostgreSQL server)
#   make test   the test suite (dev extras and a PostgreSQL server for the fleet tests)
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup setup-demo test lint demo bench probe-object probe-kernels clean

setup:
	@EXTRAS=dev POSTGRES=1 ./.ci/setup.sh

setup-demo:
	@EXTRAS=engine POSTGRES=0 ./.ci/setup.sh

test: setup
	$(PY) -m pytest -ra $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check auditor probes collectors replay tests bench
	$(VENV)/bin/mypy auditor

demo: setup-demo
	$(VENV)/bin/auditor demo

bench: setup
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# After a change to probes/disconnect.bpf.c or disconnect.h (as root: bcc compiles and loads it);
# tests/test_probe_prebuilt.py fails until the object is rebuilt.
probe-object: setup
	$(PY) -m probes.prebuild

# The prebuilt probe on Debian's 5.10, 6.1 and 6.12 kernels, each in a virtual machine.
probe-kernels: setup
	$(PY) bench/probe_kernels.py --pytest

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
