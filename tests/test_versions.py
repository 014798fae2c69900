"""What depends on the installed vLLM-Omni version (``make test-versions`` runs this module in one venv per release):
the plugin loads through ``load_omni_general_plugins`` and installs the default optimizations the upstream code
allows (only a release below the floor is refused, unless forced), ``list --json`` says the same before and after the
model import, and the default stack is bitwise ``none`` on the tiny text-to-image and edit pipelines.
:data:`KNOWN_GAPS`: per series, default optimizations that do not act; ``VERSIONS_REPORT`` receives the JSON figures.
"""

from __future__ import annotations

import json
import os
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import last_json, run_python
from vllm_omni_ascend_opt import _plugin, _report, api, flags, registry
from vllm_omni_ascend_opt._state import release_tuple
from vllm_omni_ascend_opt.blocks.upstream import fingerprints
from vllm_omni_ascend_opt.testbed import TINY_FAMILY, build_model_dir
from vllm_omni_ascend_opt.testbed.pipeline import generate, load_pipeline, sample_image

pytestmark = pytest.mark.versions

OMNI = metadata.version("vllm-omni")
SERIES = ".".join(OMNI.split(".")[:2])
#: Above the floor: what installs is then decided by the code (the fingerprints), not by this version string.
SUPPORTED = release_tuple(OMNI) >= fingerprints.MIN_OMNI
FORCED = flags.force_from_env()
#: The default optimizations that act on CPU (the others need torch_npu) on a version the plugin fully supports.
NPU_FREE_DEFAULT = ["shared_modulation", "rope", "vae_exact", "joint_attention"]
#: Per vLLM-Omni series: default optimizations that do not act there, and a phrase of the reason they give.
KNOWN_GAPS: dict[str, dict[str, str]] = {"0.30": {}, "0.31": {}, "0.32": {}}
GAPS = KNOWN_GAPS.get(SERIES)


def _report_json(name: str, data: Any) -> None:
    out = os.environ.get("VERSIONS_REPORT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps({"vllm_omni": OMNI, "forced": FORCED, **data}, indent=1))


def _expected_acting() -> list[str]:
    assert GAPS is not None, f"vllm-omni {OMNI}: no KNOWN_GAPS entry for series {SERIES}; add one after checking it"
    return [n for n in NPU_FREE_DEFAULT if n not in GAPS]


def _check_gap_reasons(reasons: dict[str, list[str]]) -> None:
    for name, phrase in (GAPS or {}).items():
        assert any(phrase in r for r in reasons[name]), (name, phrase, reasons[name])


@pytest.fixture(scope="module")
def worker() -> dict[str, Any]:
    """A fresh process as vLLM-Omni starts one: plugins, ``list --json``, model import, ``list`` again."""
    code = """
        import contextlib, io, json, sys
        from vllm_omni.plugins import load_omni_general_plugins
        load_omni_general_plugins()
        from vllm_omni_ascend_opt import _plugin, _state, installed, registry
        from vllm_omni_ascend_opt.cli import main
        T = "vllm_omni.diffusion.models.qwen_image.qwen_image_transformer"

        def listed():
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                rc = main(["list", "--json"])
            models = sorted(m for m in sys.modules if m.startswith("vllm_omni.diffusion.models."))
            return {
                **json.loads(buf.getvalue()), "rc": rc, "transformer_imported": T in sys.modules,
                "vllm_omni_imported": models,
            }

        plain = listed()
        import vllm_omni.diffusion.models.qwen_image  # the worker imports the model package after the plugins
        from vllm_omni.diffusion.models.qwen_image import pipeline_qwen_image  # noqa: F401
        print(json.dumps({
            "registered": _state.STATE.registered,
            "version_error": _state.STATE.version_error,
            "selected": _plugin.selected(),
            "installed": installed(),
            "reasons": {o.name: o.reasons_inactive() for o in registry.all_optimizations()},
            "list_plain": plain,
            "list_imported": listed(),
        }))
    """
    got = last_json(run_python(code, timeout=600, VLLM_OMNI_ASCEND_OPT="default"))
    _report_json("plugin_loader", {k: v for k, v in got.items() if not k.startswith("list_")})
    for k in ("list_plain", "list_imported"):
        _report_json(k, got[k])
    return got


def test_plugin_loads_through_vllm_omni_plugin_loader(worker):
    """Exactly what vLLM-Omni's processes do: ``load_omni_general_plugins()``, then the model package is imported."""
    for series, gaps in KNOWN_GAPS.items():
        assert set(gaps) <= set(registry.default_names()), (series, gaps)
    got = worker
    assert got["registered"], "the vllm_omni.general_plugins entry point did not run"
    if not SUPPORTED and not FORCED:
        assert got["selected"] == [] and got["installed"] == [], got
        assert OMNI in got["version_error"], got["version_error"]
        return
    assert got["selected"] == registry.default_names()
    # installed: exactly the selected ones with no reason (the gate is the optimization's own, in that process)
    assert got["installed"] == [n for n in got["selected"] if not got["reasons"][n]], got
    assert [n for n in got["installed"] if n in NPU_FREE_DEFAULT] == _expected_acting(), got["reasons"]
    _check_gap_reasons(got["reasons"])


def test_list_json_says_for_every_optimization_whether_it_acts_the_same_before_and_after_the_model_import(worker):
    for imported in (False, True):
        got = worker["list_imported" if imported else "list_plain"]
        assert got["rc"] == 0 and got["vllm_omni"] == OMNI
        assert got["transformer_imported"] is imported
        rows = {o["name"]: o for o in got["optimizations"]}
        assert list(rows) == registry.names()
        for o in rows.values():
            assert o["active"] or o["reasons_inactive"], o  # nothing is silently off
        active = [n for n in NPU_FREE_DEFAULT if rows[n]["active"]]
        if not SUPPORTED and not FORCED:
            assert active == [] and all(OMNI in " ".join(rows[n]["reasons_inactive"]) for n in NPU_FREE_DEFAULT)
            continue
        assert active == _expected_acting(), {n: rows[n]["reasons_inactive"] for n in NPU_FREE_DEFAULT}
        _check_gap_reasons({n: o["reasons_inactive"] for n, o in rows.items()})
        # every optimization's upstream code matches a fingerprint it knows for this release (checked ones)
        assert {n: [f for f in o["upstream"] if not f["ok"]] for n, o in rows.items()} == {n: [] for n in rows}
        assert all(o["upstream"] for o in rows.values())  # each declares the upstream functions it relies on
    # the fingerprints come from the source files: before and after the model import ``list`` says the same
    plain = {o["name"]: o for o in worker["list_plain"]["optimizations"]}
    imported = {o["name"]: o for o in worker["list_imported"]["optimizations"]}
    for key in ("active", "reasons_inactive", "upstream"):
        assert {n: o[key] for n, o in plain.items()} == {n: o[key] for n, o in imported.items()}, key
    assert worker["list_plain"]["vllm_omni_imported"] == []  # nothing of vLLM-Omni's models was imported to answer


# ----------------------------------------------------------------------------------------------------------------
# default vs none, bitwise, on the tiny text-to-image and edit pipelines (in-process: api.select, no version gate)
# ----------------------------------------------------------------------------------------------------------------
#: (seed, cfg_scale): CFG off and on, two seeds.
REQUESTS = ((1, 1.0), (2, 4.0))


@pytest.fixture(scope="module", params=["t2i", "edit"])
def pipeline(request, runtime):
    _plugin._reset_for_tests()
    kind = request.param
    model = build_model_dir() if kind == "t2i" else build_model_dir(TINY_FAMILY["edit"])
    pipe = load_pipeline(runtime, model=model)
    kw = {"image": sample_image(1, width=32, height=32)} if kind == "edit" else {}

    def run(seed: int, cfg: float) -> torch.Tensor:
        return generate(pipe, runtime, "a red cat", steps=2, seed=seed, cfg_scale=cfg, **kw).images

    api.select("none", model=pipe)
    refs = [run(s, c) for s, c in REQUESTS]
    _plugin._reset_for_tests()
    return kind, pipe, run, refs


def test_default_is_bitwise_none_and_acts_on_the_pipeline(pipeline):
    kind, pipe, run, refs = pipeline
    api.select("default", model=pipe)
    for (seed, cfg), ref in zip(REQUESTS, refs, strict=True):
        assert torch.equal(run(seed, cfg), ref), (kind, seed, cfg)
    assert torch.equal(run(*REQUESTS[0]), refs[0]), kind  # warm caches
    acting = _report.acting(pipe)
    reasons = {o.name: _report.explain(o, pipe) for o in registry.all_optimizations()}
    _report_json(f"acting_{kind}", {"acting": acting, "reasons": reasons})
    assert [n for n in acting if n in NPU_FREE_DEFAULT] == _expected_acting(), reasons
    _check_gap_reasons(reasons)
