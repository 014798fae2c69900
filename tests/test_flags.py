"""VLLM_OMNI_ASCEND_OPT parsing: every form, and every bad input."""

from __future__ import annotations

import logging

import pytest

from vllm_omni_ascend_opt import _env, flags, registry

ALL = [
    "shared_modulation",
    "rope",
    "fused_attention",
    "nz_weights",
    "vae_exact",
    "vae_fast",
    "joint_attention",
    "qk_norm",
    "fast_modulate",
    "fast_residual",
    "memo_aware_offload",
]
DEFAULT = [n for n in ALL if n not in ("vae_fast", "fast_modulate", "fast_residual")]


def test_registry_names_and_order():
    assert registry.names() == ALL
    assert registry.default_names() == DEFAULT
    classes = {o.name: o.equivalence for o in registry.all_optimizations()}
    assert classes == {
        "shared_modulation": "exact",
        "rope": "pixel",  # its weakest tier (the NPU kernel); exact on the portable path, see Rope.tier()
        "joint_attention": "exact",
        "qk_norm": "pixel",
        "fused_attention": "close",
        "nz_weights": "close",
        "vae_exact": "exact",
        "vae_fast": "close",
        "fast_modulate": "close",
        "fast_residual": "close",
        "memo_aware_offload": "exact",
    }


@pytest.mark.parametrize(
    "spec, want",
    [
        (None, DEFAULT),
        ("", DEFAULT),
        ("default", DEFAULT),
        ("all", ALL),
        ("none", []),
        ("default,-nz_weights", [n for n in DEFAULT if n != "nz_weights"]),
        ("none,+rope", ["rope"]),
        ("none, +rope ,+vae_fast", ["rope", "vae_fast"]),
        ("rope,shared_modulation", ["shared_modulation", "rope"]),  # registry order, not spec order
        (
            "all,-vae_fast,-vae_exact,-joint_attention",
            [n for n in ALL if n not in ("vae_fast", "vae_exact", "joint_attention")],
        ),
        ("rope,none", []),  # a later base resets
        ("default,+vae_fast", [n for n in ALL if n in DEFAULT or n == "vae_fast"]),  # registry order
        ("default,+vae_fast,+fast_modulate,+fast_residual", ALL),
        ("-rope", []),  # removing from an empty explicit list
    ],
)
def test_parse(spec, want):
    assert flags.parse_spec(spec) == want


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("bogus", "unknown optimization 'bogus'"),
        ("default,-bogus", "unknown optimization 'bogus'"),
        ("default,,rope", "empty item"),
        ("default,", "empty item"),
        ("+", "malformed item"),
        ("-", "malformed item"),
        ("rope;vae_exact", "malformed item"),
        ("++rope", "malformed item"),
        ("ROPE", "unknown optimization 'ROPE'"),
    ],
)
def test_bad_specs_list_valid_names(spec, fragment):
    with pytest.raises(flags.FlagError) as exc:
        flags.parse_spec(spec)
    msg = str(exc.value)
    assert fragment in msg and all(name in msg for name in ALL), msg


@pytest.mark.parametrize("value, want", [("1", True), ("true", True), ("ON", True), ("0", False), ("", False)])
def test_strict_env(monkeypatch, value, want):
    monkeypatch.setenv(flags.ENV_STRICT, value)
    assert flags.strict_from_env() is want


@pytest.mark.parametrize("value", ["2", "enable", "yes please"])
def test_a_boolean_env_var_with_another_spelling_warns_once(monkeypatch, caplog, value):
    """The usual spellings are booleans; anything else (STRICT=2) is false with one warning."""
    monkeypatch.setattr(_env, "_warned", set())
    monkeypatch.setenv(flags.ENV_STRICT, value)
    with caplog.at_level(logging.WARNING, logger="vllm_omni_ascend_opt"):
        assert flags.strict_from_env() is False and flags.strict_from_env() is False
    assert caplog.text.count(f"{flags.ENV_STRICT}={value!r} is not a boolean") == 1
    for spelling, want in (("Yes", True), (" off ", False), ("TRUE", True), ("no", False)):
        monkeypatch.setenv(flags.ENV_FORCE, spelling)
        assert flags.force_from_env() is want


def test_a_budget_outside_its_range_warns(monkeypatch, caplog):
    from vllm_omni_ascend_opt.blocks.memo import cache

    monkeypatch.setattr(_env, "_warned", set())
    monkeypatch.setenv(cache.ENV_BUDGET_MB, "100000")
    with caplog.at_level(logging.WARNING, logger="vllm_omni_ascend_opt"):
        assert cache.budget_from_env() == 100000 * 1024**2
        monkeypatch.setenv(cache.ENV_BUDGET_MB, "512")
        assert cache.budget_from_env() == 512 * 1024**2
    assert caplog.text.count("outside the sane range 0..16384 MiB") == 1
