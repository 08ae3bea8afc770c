# Two commands on a fresh machine:  `make demo` (main job)  and  `make test` (what CI runs).
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
	$(PY) scripts/demo.py

serve: $(STAMP)
	$(PY) scripts/serve.py

test: $(STAMP)
	$(PY) -m pytest -q tests

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu tests

clean:
	rm -rf $(VENV)
