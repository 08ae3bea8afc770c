# Two commands on a fresh machine:  `make serve` (the main job: the OpenAI-compatible server)  and  `make test` (what CI runs).
# Flags pass through ARGS:  make serve ARGS='--port 8080 --max-num-seqs 32'   (also make demo ARGS='--arch v4').
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo serve test test-gpu clean

$(STAMP): pyproject.toml
	@set -e; PYBIN=$$(scripts/find_python.sh); echo "using $$PYBIN"; \
	  [ -x $(PY) ] || $$PYBIN -m venv $(VENV); \
	  $(PY) -m pip install -q --upgrade pip >/dev/null; \
	  $(PY) -m pip install -q -e '.[test]'; touch $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py $(ARGS)

serve: $(STAMP)
	$(PY) scripts/serve.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q tests

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu tests

clean:
	rm -rf $(VENV)
