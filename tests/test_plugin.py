"""register(), the post-import hook, the entry point and the Python API."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import logging
import types

import pytest

from tests.harness import run_python
from vllm_omni_ascend_opt import _patching, _plugin, api, flags, registry


def test_entry_point_is_discoverable():
    eps = importlib.metadata.entry_points(group="vllm_omni.general_plugins")
    ours = [ep for ep in eps if ep.name == "ascend_opt"]
    assert len(ours) == 1
    assert ours[0].value == "vllm_omni_ascend_opt:register"
    assert ours[0].load() is _plugin.register


def test_register_is_idempotent_and_a_bad_flag_patches_nothing_and_logs(monkeypatch, caplog):
    monkeypatch.setenv(flags.ENV_FLAG, "none,+rope")
    calls = []
    with monkeypatch.context() as m:
        m.setattr(_plugin, "set_selected", lambda names: calls.append(list(names)))
        _plugin.register()
        _plugin.register()
    assert calls == [["rope"]]
    _plugin._reset_for_tests()
    monkeypatch.setenv(flags.ENV_FLAG, "bogus")
    with caplog.at_level(logging.ERROR, logger="vllm_omni_ascend_opt"):
        _plugin.register()
    assert _plugin.selected() == []
    assert api.installed() == []
    assert "unknown optimization 'bogus'" in caplog.text
    assert "shared_modulation" in caplog.text


@pytest.mark.parametrize(
    ("spec", "match"), [("default,-nope", "Valid names"), ("none,+fused_attention", "fused_attention")]
)
def test_strict_mode_raises_on_a_bad_flag_or_a_selected_optimization_that_cannot_act(monkeypatch, spec, match):
    """fused_attention cannot be active on CPU without torch_npu."""
    monkeypatch.setenv(flags.ENV_FLAG, spec)
    monkeypatch.setenv(flags.ENV_STRICT, "1")
    with pytest.raises(_plugin.PluginConfigError, match=match):
        _plugin.register()


def test_unsupported_version_warns_once_and_patches_nothing_unless_forced(monkeypatch, caplog):
    monkeypatch.setattr(_plugin, "installed_version", lambda d: "0.29.1" if d == "vllm-omni" else "0.30.0")
    with caplog.at_level(logging.WARNING, logger="vllm_omni_ascend_opt"):
        _plugin.register()
        _plugin.register()
    warnings = [r for r in caplog.records if "not a supported version" in r.getMessage()]
    assert len(warnings) == 1
    assert _plugin.selected() == []
    rows = {r["name"]: r for r in api.status()}
    assert any("0.29.1" in w for w in rows["rope"]["reasons_inactive"])
    _plugin._reset_for_tests()
    monkeypatch.setenv(flags.ENV_FORCE, "1")
    _plugin.register()
    assert _plugin.selected() == registry.default_names()


def test_patchset_and_every_installable_optimization_restore_by_identity(tiny_pipe):
    class Owner:
        def method(self):
            return 1

    inherited = types.SimpleNamespace()
    original = Owner.__dict__["method"]
    ps = _patching.PatchSet("t")
    ps.set(Owner, "method", lambda self: 2)
    ps.set(Owner, "method", lambda self: 3)  # idempotent: the first patch stays
    assert Owner().method() == 2
    ps.set(inherited, "new_attr", 5)
    ps.revert()
    assert Owner.__dict__["method"] is original
    assert not hasattr(inherited, "new_attr")
    ps.revert()  # twice is fine
    assert Owner.__dict__["method"] is original
    # each optimization that can be active here: uninstall restores every patched attribute
    import vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image  # noqa: F401  (targets imported)

    for opt in registry.all_optimizations():
        if opt.reasons_inactive():
            continue
        opt.install()
        opt.attach(tiny_pipe)
        records = [(r.owner, r.name, r.original) for r in opt.patches._records]
        opt.uninstall()
        for owner, name, original in records:
            if original is _patching._MISSING:
                assert name not in getattr(owner, "__dict__", {})
            else:
                assert owner.__dict__[name] is original, (opt.name, name)
        assert not opt.is_attached(tiny_pipe)


def test_list_cli_json_and_a_bogus_flag_naming_valid_optimizations():
    r = run_python("from vllm_omni_ascend_opt.cli import main; raise SystemExit(main(['list', '--json']))")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    names = [o["name"] for o in data["optimizations"]]
    assert names == registry.names()
    for o in data["optimizations"]:
        assert o["active"] or o["reasons_inactive"], o  # every inactive one says why
        assert o["flag"] == {"enable": f"+{o['name']}", "disable": f"-{o['name']}"}
    r = run_python(
        "from vllm_omni_ascend_opt.cli import main; raise SystemExit(main(['list']))",
        VLLM_OMNI_ASCEND_OPT="bogus",
    )
    assert r.returncode == 1
    assert "unknown optimization 'bogus'" in r.stdout
    assert "Nothing is patched" in r.stdout
    for name in registry.names():
        assert name in r.stdout


def test_context_manager_restores_previous_selection():
    api.select("none,+vae_fast")
    with api.optimizations("none,+rope"):
        assert _plugin.selected() == ["rope"]
    assert _plugin.selected() == ["vae_fast"]
    with pytest.raises(flags.FlagError):
        api.select("rope,bogus")
    with pytest.raises(KeyError, match="valid names"):
        api.enable("bogus")
