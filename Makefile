# Two commands do all set-up on a fresh machine:  `make demo` (the main job) and `make test`.
# Both create .venv from the pinned CPU lists when it is missing, and reuse it when present.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.ascend-opt-installed
PYTEST_ARGS ?=

.PHONY: venv test demo lint list clean-venv mutation

$(STAMP): requirements/cpu-lock.txt requirements/test-lock.txt requirements/serve-lock.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements/cpu-lock.txt -r requirements/test-lock.txt \
		-r requirements/serve-lock.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	@touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# The mutation check (docs/testing.md): every named bug in tools/mutations.toml must make its tests fail.
# Each mutant runs in a scratch copy of the repository; MUTATION_ARGS e.g. "-k rope -j 1".
MUTATION_ARGS ?=
mutation: $(STAMP)
	$(PY) tools/mutation_check.py $(MUTATION_ARGS)

# The demo: a leave-one-out ablation of the embedded tiny Qwen-Image on CPU (workload tiny-cpu, ~2 min on 2 cores when the machine is quiet).
# It succeeds when the reports are written; the verdict (exit 0 PASS / 1 FAIL / 2 INCONCLUSIVE) is printed.
DEMO_OUT ?= ablation-out/demo
demo: $(STAMP)
	@t0=$$(date +%s); rc=0; \
	$(VENV)/bin/vllm-omni-ascend-opt ablate --workload tiny-cpu --out $(DEMO_OUT) --fresh || rc=$$?; \
	if [ ! -f $(DEMO_OUT)/report.md ]; then echo "demo: no report was written (exit code $$rc)"; exit 1; fi; \
	echo; echo "demo: finished in $$(( $$(date +%s) - t0 )) s; ablation exit code $$rc (0 PASS, 1 FAIL, 2 INCONCLUSIVE)"; \
	echo "demo: report $(DEMO_OUT)/report.md  (also results.json, ablation.png, images/ in $(DEMO_OUT))"

list: $(STAMP)
	$(VENV)/bin/vllm-omni-ascend-opt list

# Lint: ruff, and the import contract (pyproject.toml [tool.importlinter]: the core never imports the lab, layers,
# optimizations independent of each other).
lint: $(STAMP)
	$(VENV)/bin/ruff check vllm_omni_ascend_opt tests benchmarks patches tools
	$(VENV)/bin/ruff format --check vllm_omni_ascend_opt tests benchmarks patches tools
	$(VENV)/bin/lint-imports

clean-venv:
	rm -rf $(VENV)
