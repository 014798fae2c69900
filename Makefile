# Two commands do all set-up on a fresh machine:  `make demo` (the main job) and `make test`.
# Both create .venv from the pinned CPU lists when it is missing, and reuse it when present.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.ascend-opt-installed
PYTEST_ARGS ?=

.PHONY: venv test demo lint list clean-venv mutation test-versions venvs

# The pinned CPU environment: the locks shared by every vLLM-Omni version, plus one small overlay per version
# (requirements/omni-<version>.txt: vLLM, vLLM-Omni and what they pin differently). .venv is vLLM-Omni 0.30.
LOCKS = requirements/cpu-lock.txt requirements/test-lock.txt requirements/serve-lock.txt
PIP_INSTALL = -m pip install -q --disable-pip-version-check --no-deps

# The locks go in with uv (parallel downloads, unpacking and byte-compiling), pip where uv cannot: uv reads no pip
# configuration, so pip's find-links (where a machine keeps its torch +cpu wheel) are passed on.
UV_VERSION = 0.13.8
UV_INSTALL = $(VENV)/bin/uv pip install -q --no-deps --compile-bytecode $(foreach d,$(PIP_FIND_LINKS),--find-links $(d))
$(STAMP): $(LOCKS) requirements/omni-0.30.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) $(PIP_INSTALL) uv==$(UV_VERSION)
	$(UV_INSTALL) --python $(PY) $(addprefix -r ,$(LOCKS)) -r requirements/omni-0.30.txt || \
		$(PY) $(PIP_INSTALL) $(addprefix -r ,$(LOCKS)) -r requirements/omni-0.30.txt
	$(PY) $(PIP_INSTALL) --no-build-isolation -e .
	@touch $(STAMP)

# The version matrix (issue 22): .venv-<version> for each other vLLM-Omni version, cached like .venv. An overlay
# venv: it installs only requirements/omni-<version>.txt and the plugin, and reads the shared locks from .venv's
# site-packages through a .pth line placed after its own (so its own vllm, vllm-omni, transformers... win);
# --ignore-installed: pip never touches what it sees in .venv.
OTHER_VERSIONS = 0.31 0.32
SHARED_PTH = zz-ascend-opt-shared-locks.pth
.venv-%/.ascend-opt-installed: $(STAMP) requirements/omni-%.txt pyproject.toml
	@test -x .venv-$*/bin/python || $(PYTHON) -m venv --without-pip .venv-$*
	$(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
		"$$(.venv-$*/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/$(SHARED_PTH)"
	$(UV_INSTALL) --python .venv-$*/bin/python -r requirements/omni-$*.txt || \
		.venv-$*/bin/python $(PIP_INSTALL) --ignore-installed -r requirements/omni-$*.txt
	.venv-$*/bin/python $(PIP_INSTALL) --ignore-installed --no-build-isolation -e .
	@touch $@

venvs: $(STAMP) $(foreach v,$(OTHER_VERSIONS),.venv-$(v)/.ascend-opt-installed)

# tests/test_versions.py (marker `versions`) and patches/check.py --exactness in every venv of the matrix (the patch
# series, cut against 0.32.0rc1, is applied and compared with the plugin in .venv-0.32), then a summary per version
# (tools/test_versions.py), 0.31 and 0.32 side by side (0.30 is .venv: make test runs the whole suite there).
# TEST_VERSIONS_ARGS e.g. "0.32=.venv-0.32" for one version.
TEST_VERSIONS_ARGS ?=
test-versions: venvs
	$(PY) tools/test_versions.py $(TEST_VERSIONS_ARGS)

venv: $(STAMP)

# The suite in pytest-xdist workers, a module (or a named xdist_group) per unit, the heavy ones first
# (tests/conftest.py); PYTEST_WORKERS=0 runs it in this process. The project is byte-compiled first: the many child
# interpreters of the suite then read it, also where PYTHONDONTWRITEBYTECODE keeps them from writing it.
PYTEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m compileall -q vllm_omni_ascend_opt tests >/dev/null
	$(PY) -m pytest $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder) $(PYTEST_ARGS)

# The mutation check (docs/testing.md): every named bug in tools/mutations.toml must make its tests fail.
# Each mutant runs in a scratch copy of the repository; MUTATION_ARGS e.g. "-k rope -j 1".
MUTATION_ARGS ?=
mutation: $(STAMP)
	$(PY) tools/mutation_check.py $(MUTATION_ARGS)

# The demo: a leave-one-out ablation of the embedded tiny Qwen-Image on CPU (workload tiny-cpu, ~3.5 min on 2 cores).
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
	rm -rf $(VENV) $(foreach v,$(OTHER_VERSIONS),.venv-$(v))
