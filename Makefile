# Two commands on a fresh machine:  `make serve` (the main job: the OpenAI-compatible server)  and  `make test` (what CI runs).
# Flags pass through ARGS:  make serve ARGS='--port 8080 --max-num-seqs 32'   (also make demo ARGS='--arch v4').
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo serve test test-all test-gpu clean

$(STAMP): pyproject.toml
	@set -e; PYBIN=$$(scripts/find_python.sh); echo "using $$PYBIN"; \
	  [ -x $(PY) ] || $$PYBIN -m venv $(VENV); \
	  $(PY) -m pip install -q --upgrade pip >/dev/null; \
	  $(PY) -m pip install -q -e '.[test]'; touch $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py $(ARGS)

serve: $(STAMP)
	$(PY) scripts/serve.py $(ARGS)

# progress as "[ n/N]" per test line (readable in CI logs), the 15 slowest tests at the end
PYTEST_FLAGS := -o console_output_style=count --durations=15

# two pytest-xdist workers (the suite is mostly single-threaded Python and XLA compiles): 509 s instead of 750 s
# serially on a 2-core machine (2026-12-01); work stealing, so that a long test near the end does not leave a
# worker idle (551 s against 527-601 s of plain load scheduling on this machine, later that day, noisy);
# TEST_WORKERS=0 runs it in one process
test: $(STAMP)
	$(PY) -m pytest $(PYTEST_FLAGS) -n $(or $(TEST_WORKERS),2) --dist worksteal -m "not slow" tests

test-all: $(STAMP)
	$(PY) -m pytest $(PYTEST_FLAGS) tests

# the gpu-marked tests are compile-bound: 6 pytest workers share the one GPU (no preallocation), so the
# suite fits one 10-minute call
test-gpu: $(STAMP)
	XLA_PYTHON_CLIENT_PREALLOCATE=false $(PY) -m pytest $(PYTEST_FLAGS) -n $(or $(GPU_WORKERS),6) -m gpu tests

clean:
	rm -rf $(VENV)
