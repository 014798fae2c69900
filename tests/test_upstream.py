"""Gate by the code, not the version: ``blocks/upstream/fingerprints.py`` and the ``upstream`` tables, on a synthetic
upstream module (differences, ``FORCE``, newer releases, ``ABSENT``, platforms, run-time replacements), on the real
tables (marker ``versions``) and on 0.32.0rc1's AdaLayerNorm dispatch (``forward_cuda`` / ``forward_musa``).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
import os
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest
import torch

from tests import test_shared_modulation as sm
from tests.harness import last_json, run_python
from vllm_omni_ascend_opt import _plugin, api, flags, registry
from vllm_omni_ascend_opt._state import STATE
from vllm_omni_ascend_opt.blocks.upstream import ada_norm, fingerprints
from vllm_omni_ascend_opt.blocks.upstream.fingerprints import ABSENT, Upstream
from vllm_omni_ascend_opt.optimization import Optimization

OMNI = metadata.version("vllm-omni")

METHOD_V1 = """def m(self, x):
    return x + 1
"""
METHOD_V2 = """def m(self, x):
    return x + 2  # a newer release
"""


def _src(method: str) -> str:
    return "class C:\n" + textwrap.indent(method, "    ") + "\n\ndef helper():\n    return 0\n"


def _fp(text: str) -> str:
    """The fingerprint: sha256 of the dedented ``inspect.getsource`` text."""
    return hashlib.sha256(textwrap.dedent(text).encode()).hexdigest()[:16]


class _Probe(Optimization):
    name = "upstream_probe"
    summary = "test-only"
    equivalence = "exact"
    target_modules = ("ascend_opt_upstream_probe",)
    upstream = (Upstream("ascend_opt_upstream_probe", "C.m", {_fp(METHOD_V1): ("0.30.0", "0.31.0rc1")}),)

    def _install(self):
        self.patches.set(sys.modules["ascend_opt_upstream_probe"], "patched", True)


@pytest.fixture
def probe(monkeypatch, tmp_path):
    """A synthetic upstream module (not imported) and an optimization that declares its ``C.m``."""
    path = tmp_path / "ascend_opt_upstream_probe.py"
    path.write_text(_src(METHOD_V1))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("ascend_opt_upstream_probe", None)
    opt = registry.register_optimization(_Probe())
    yield opt, path
    opt.uninstall()
    registry.REGISTRY.remove(opt.name)
    sys.modules.pop("ascend_opt_upstream_probe", None)


def _rewrite(path: Path, text: str) -> None:
    path.write_text(text)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new mtime even on coarse clocks


def test_known_code_installs_a_difference_turns_it_off_and_force_installs_anyway_with_one_warning(
    probe, monkeypatch, caplog
):
    opt, path = probe
    assert opt.reasons_inactive() == []  # matches, read from the file: nothing imported
    assert "ascend_opt_upstream_probe" not in sys.modules
    (finding,) = opt.upstream_findings()
    assert finding.ok and finding.matches == ("0.30.0", "0.31.0rc1")

    _rewrite(path, _src(METHOD_V2))  # upstream changed C.m
    (why,) = opt.reasons_inactive()
    assert why.startswith("upstream C.m differs from the code upstream_probe knows (vLLM-Omni 0.30.0, 0.31.0rc1)")
    assert f"source fingerprint {_fp(METHOD_V2)}" in why and _fp(METHOD_V1) in why
    _plugin.set_selected(["upstream_probe"])
    importlib.import_module("ascend_opt_upstream_probe")
    assert not opt.installed  # the post-import hook asked, and it stays off
    row = next(r for r in api.status() if r["name"] == "upstream_probe")
    assert not row["active"] and why in row["reasons_inactive"]
    assert row["upstream"] == [
        {
            "function": "ascend_opt_upstream_probe:C.m",
            "fingerprint": _fp(METHOD_V2),
            "matches": [],
            "checked": True,
            "platforms": [],
            "replaced": "",
            "ok": False,
        }
    ]
    monkeypatch.setenv(flags.ENV_FORCE, "1")
    assert opt.reasons_inactive() == []  # forced: not a reason...
    assert any(n.startswith(f"{flags.ENV_FORCE}=1: acts although upstream C.m differs") for n in opt.upstream_notes())
    with caplog.at_level(logging.WARNING, logger="vllm_omni_ascend_opt"):
        _plugin.set_selected(["upstream_probe"])
        importlib.import_module("ascend_opt_upstream_probe")
        _plugin.install_ready()
    assert opt.installed and sys.modules["ascend_opt_upstream_probe"].patched is True
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "installing upstream_probe although upstream C.m differs" in warned[0]


def test_post_import_hook_installs_when_the_target_is_imported_and_at_once_where_it_is(probe):
    opt, _path = probe
    _plugin.set_selected(["upstream_probe"])
    assert not opt.installed  # target not imported yet: nothing patched, nothing imported
    assert "ascend_opt_upstream_probe" not in sys.modules
    mod = importlib.import_module("ascend_opt_upstream_probe")
    assert opt.installed and mod.patched is True
    opt.uninstall()
    assert not hasattr(mod, "patched")
    _plugin.set_selected([])
    _plugin.set_selected(["upstream_probe"])  # already imported: patched at once
    assert opt.installed and mod.patched is True
    _plugin.set_selected([])
    assert not opt.installed and not hasattr(mod, "patched")


def test_a_newer_release_fingerprint_listed_as_known_is_accepted_and_absent_is_a_fingerprint(probe, monkeypatch):
    opt, path = probe
    newer = Upstream("ascend_opt_upstream_probe", "C.m", {_fp(METHOD_V1): ("0.30.0",), _fp(METHOD_V2): ("0.99.0",)})
    monkeypatch.setattr(opt, "upstream", (newer,))
    _rewrite(path, _src(METHOD_V2))
    assert opt.reasons_inactive() == []
    (finding,) = opt.upstream_findings()
    assert finding.matches == ("0.99.0",)
    assert (
        fingerprints.summary([finding]) == "1/1 upstream functions match a known fingerprint (as in vLLM-Omni 0.99.0)"
    )
    _rewrite(path, _src(METHOD_V1))
    assert opt.reasons_inactive() == [] and opt.upstream_findings()[0].matches == ("0.30.0",)
    new_fn = Upstream("ascend_opt_upstream_probe", "C.n", {ABSENT: ("0.30.0",), _fp(METHOD_V1): ("0.32.0rc1",)})
    monkeypatch.setattr(opt, "upstream", (new_fn,))
    assert opt.reasons_inactive() == []  # not there, as in 0.30.0
    only_present = Upstream("ascend_opt_upstream_probe", "C.n", {_fp(METHOD_V1): ("0.32.0rc1",)})
    monkeypatch.setattr(opt, "upstream", (only_present,))
    (why,) = opt.reasons_inactive()
    assert "upstream C.n is missing from ascend_opt_upstream_probe" in why and "0.32.0rc1" in why


def test_platform_declarations_are_checked_only_on_their_platform_and_replaced_at_run_time_is_a_difference(
    probe, monkeypatch, fake_npu
):
    opt, _path = probe
    decl = Upstream("ascend_opt_upstream_probe", "C.m", {"0" * 16: ("0.30.0",)}, ("cuda",))
    assert fingerprints.reasons([decl], "p", platform="cpu") == []
    assert fingerprints.reasons([decl], "p", platform="npu") == []
    (why,) = fingerprints.reasons([decl], "p", platform="cuda")
    assert why.startswith("upstream C.m (on cuda) differs")
    (finding,) = fingerprints.check([decl], platform="cpu")
    assert not finding.applies and finding.ok and "not checked on" in fingerprints.summary([finding])
    assert fingerprints.current_platform() == "cpu"
    mod = importlib.import_module("ascend_opt_upstream_probe")
    assert opt.reasons_inactive() == []

    def ours(self, x):  # a wrapper that says what it wraps (the plugin's own patches do)
        return stock(self, x)

    stock = mod.C.m
    ours.__wrapped__ = stock
    monkeypatch.setattr(mod.C, "m", ours)
    assert opt.reasons_inactive() == []

    def foreign(self, x):
        return x + 3

    monkeypatch.setattr(mod.C, "m", foreign)
    (why,) = opt.reasons_inactive()
    assert why.startswith("upstream C.m is replaced at run time (ascend_opt_upstream_probe): it is")
    assert "foreign" in why
    fake_npu()
    assert fingerprints.current_platform() == "npu"  # the plugin's one torch_npu probe decides


def test_newer_release_with_known_code_just_works_with_one_info_note(monkeypatch, caplog):
    monkeypatch.setattr(_plugin, "installed_version", lambda d: "0.33.0")
    with caplog.at_level(logging.INFO, logger="vllm_omni_ascend_opt"):
        _plugin.register()
    notes = [r for r in caplog.records if "is not one of the releases" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.INFO and "0.33.0" in notes[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert STATE.version_error is None and STATE.omni_version == "0.33.0"
    assert _plugin.selected() == registry.default_names()
    importlib.import_module("vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image")
    importlib.import_module("vllm_omni.diffusion.distributed.autoencoders.autoencoder_kl_qwenimage")
    can_act = [o.name for o in registry.all_optimizations() if o.name in STATE.selected and not o.reasons_inactive()]
    assert can_act and api.installed() == can_act  # whatever the code allows, not the version string


@pytest.mark.parametrize(("version", "refused"), [("0.29.1", True), ("0.30.1", False), ("1.0.0", False)])
def test_only_the_floor_is_a_version_fact(version, refused):
    STATE.check_version(version)
    assert (STATE.version_error is not None) is refused
    assert (STATE.version_note is not None) is (not refused and version not in fingerprints.KNOWN_OMNI)
    STATE.reset()


def _declarations() -> list[tuple[str, Upstream]]:
    return [(o.name, d) for o in registry.all_optimizations() for d in o.upstream]


@pytest.mark.versions
def test_every_optimization_declares_code_whose_source_fingerprints_equal_inspect_getsource():
    """The file-based fingerprint equals ``inspect.getsource``'s of the very function in that file."""
    assert {n for n, _ in _declarations()} == set(registry.names())
    for d in {(d.module, d.qualname): d for _, d in _declarations()}.values():
        fp = fingerprints.fingerprint(d.module, d.qualname)
        mod = importlib.import_module(d.module)
        found, obj = fingerprints.live(d.module, d.qualname)
        if fp == ABSENT:
            assert not found, d
            continue
        assert found, d
        fn = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
        assert _fp(inspect.getsource(fn)) == fp, d
        assert fingerprints.replacement(d.module, d.qualname) == "", d
        assert mod.__name__ == d.module


@pytest.mark.versions
def test_declared_code_is_known_for_this_release():
    """Every declared function (per-platform ones too) matches a fingerprint listed for this release."""
    if OMNI not in fingerprints.KNOWN_OMNI:
        pytest.skip(f"vllm-omni {OMNI} is not a release the tables list")
    wrong = {}
    for owner, d in _declarations():
        fp = fingerprints.fingerprint(d.module, d.qualname)
        if OMNI not in d.known.get(fp, ()):
            wrong[f"{owner}: {d.name}"] = fp
    assert wrong == {}
    for plat in fingerprints.PLATFORMS:
        assert {o.name: fingerprints.reasons(o.upstream, o.name, plat) for o in registry.all_optimizations()} == {
            o.name: [] for o in registry.all_optimizations()
        }


@pytest.mark.versions
def test_reasons_and_list_need_no_vllm_omni_import():
    """Reasons, ``list`` rows and findings come from the source files: no vLLM-Omni import needed."""
    code = """
        import json, sys
        from vllm_omni_ascend_opt import api, registry
        reasons = {o.name: o.reasons_inactive() for o in registry.all_optimizations()}
        rows = api.status()
        print(json.dumps({"imported": sorted(m for m in sys.modules if m.split(".")[0] in ("vllm_omni", "vllm")),
                          "reasons": reasons, "ok": all(f["ok"] for r in rows for f in r["upstream"])}))
    """
    got = last_json(run_python(code))
    assert got["imported"] == [] and got["ok"], got
    assert not any("upstream" in why for rs in got["reasons"].values() for why in rs), got["reasons"]


# ----------------------------------------------------------------------------------------------------------------
# 0.32.0rc1's AdaLayerNorm: forward_cuda takes a Triton kernel when it can, forward_musa is native
# ----------------------------------------------------------------------------------------------------------------
class _FusedAdaLNSpy:
    """0.32.0rc1's CUDA Triton AdaLN kernel (``adalayernorm._adaln_fused_forward``) as stock's native result plus a
    marker offset: a memoized path mirroring ``forward_native`` instead of calling the instance cannot equal stock."""

    OFFSET = 2.0**-10

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module, x, scale, shift):
        self.calls += 1
        return module.forward_native(x, scale, shift) + self.OFFSET


def _forward_cuda_032(self, x, scale, shift):
    """0.32.0rc1's ``AdaLayerNorm.forward_cuda`` (adalayernorm.py lines 315-326), for releases before it."""
    fused = sys.modules[ada_norm.ADALAYERNORM_MODULE]._adaln_fused_forward
    if fused is None:
        return self.forward_native(x, scale, shift)
    out = fused(self, x, scale, shift)
    return out if out is not None else self.forward_native(x, scale, shift)


@pytest.fixture
def ada(monkeypatch, runtime):
    """vLLM-Omni's adalayernorm module with 0.32.0rc1's forward_cuda (its own on 0.32, a copy before)."""
    sm.T()
    mod = sys.modules[ada_norm.ADALAYERNORM_MODULE]
    if "_adaln_fused_forward" not in vars(mod):
        monkeypatch.setattr(mod.AdaLayerNorm, "forward_cuda", _forward_cuda_032)
        monkeypatch.setattr(mod, "_adaln_fused_forward", None, raising=False)
    return mod


def _norms(tr) -> list:
    return [n for b in tr.transformer_blocks for n in (b.img_norm1, b.img_norm2, b.txt_norm1, b.txt_norm2)]


@pytest.mark.versions
@pytest.mark.parametrize("kernel", [False, True], ids=["without-triton", "with-the-fused-kernel"])
def test_forward_cuda_is_native_only_without_the_fused_kernel(ada, runtime, monkeypatch, kernel):
    spy = _FusedAdaLNSpy()
    monkeypatch.setattr(ada, "_adaln_fused_forward", spy if kernel else None)
    tr = sm.build(runtime)
    norms = _norms(tr)
    for n in norms:  # what CustomOp binds at construction on a CUDA platform
        n._forward_method = n.forward_cuda
    assert {ada_norm.norm_kind(n) for n in norms} == {ada_norm.OPAQUE if kernel else ada_norm.NATIVE}
    _memo_is_bitwise_stock(tr, runtime, spy, 4 * sm.L if kernel else 0)


def _memo_is_bitwise_stock(tr, runtime, spy: _FusedAdaLNSpy | None = None, stock_calls: int = 0) -> None:
    """Cold and warm memoized forwards equal stock's, calling the (fused-kernel) instance as often."""
    kw = sm.inputs(torch.float32, batch=2, pad=2)
    api.select("none", model=tr)
    want = sm.fwd(tr, runtime, kw)
    per_forward = spy.calls if spy else 0
    assert per_forward == stock_calls
    api.select(sm.ON, model=tr)
    assert torch.equal(sm.fwd(tr, runtime, kw), want) and torch.equal(sm.fwd(tr, runtime, kw), want)  # cold, warm
    assert (spy.calls if spy else 0) == 3 * per_forward
    assert sm.OPT.memo.stats["hits"] > 0 and sm.OPT.fallback_reasons() == {}


@pytest.mark.versions
def test_forward_musa_is_native_where_adalayernorm_defines_it(ada, runtime, monkeypatch):
    tr = sm.build(runtime)
    norms = _norms(tr)
    if "forward_musa" not in vars(ada.AdaLayerNorm):  # before 0.32: CustomOp's (-> forward_cuda), called as it is
        norms[0]._forward_method = norms[0].forward_musa
        assert ada_norm.norm_kind(norms[0]) == ada_norm.OPAQUE
        monkeypatch.setattr(ada.AdaLayerNorm, "forward_musa", _forward_musa_032, raising=False)
    for n in norms:
        n._forward_method = n.forward_musa
    assert {ada_norm.norm_kind(n) for n in norms} == {ada_norm.NATIVE}
    _memo_is_bitwise_stock(tr, runtime)


def _forward_musa_032(self, x, scale, shift):
    """0.32.0rc1's ``AdaLayerNorm.forward_musa``, for releases before it."""
    return self.forward_native(x, scale, shift)
