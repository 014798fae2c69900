# Two commands do all set-up on a fresh machine:  `make demo` (the main job) and `make test`.
# Both create .venv from the pinned CPU lists when it is missing, and reuse it when present.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.ascend-opt-installed
PYTEST_ARGS ?=

.PHONY: venv test demo lint list clean-venv bench

$(STAMP): requirements/cpu-lock.txt requirements/test-lock.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements/cpu-lock.txt -r requirements/test-lock.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	@touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m vllm_omni_ascend_opt.demo

list: $(STAMP)
	$(VENV)/bin/vllm-omni-ascend-opt list

lint: $(STAMP)
	$(VENV)/bin/ruff check vllm_omni_ascend_opt tests benchmarks
	$(VENV)/bin/ruff format --check vllm_omni_ascend_opt tests benchmarks

clean-venv:
	rm -rf $(VENV)
