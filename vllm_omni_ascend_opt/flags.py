"""Parsing of the ``VLLM_OMNI_ASCEND_OPT`` flag.

Grammar (comma separated, whitespace ignored)::

    spec   := base ("," item)*  |  item ("," item)*
    base   := "default" | "all" | "none"
    item   := "+"name | "-"name | name | base

A spec that starts with a name selects exactly those names; a later base resets the selection. Unknown names and
malformed items raise :class:`FlagError`, whose message lists the valid names.
"""

from __future__ import annotations

import os

from vllm_omni_ascend_opt import _env, registry
from vllm_omni_ascend_opt.blocks.upstream import fingerprints

ENV_FLAG = "VLLM_OMNI_ASCEND_OPT"
ENV_STRICT = "VLLM_OMNI_ASCEND_OPT_STRICT"
#: Install even where upstream code (or the vLLM-Omni version) is not one the plugin knows (owned by ``fingerprints``).
ENV_FORCE = fingerprints.ENV_FORCE
BASES = ("default", "all", "none")


class FlagError(ValueError):
    """A malformed ``VLLM_OMNI_ASCEND_OPT`` value."""


def parse_spec(spec: str | None) -> list[str]:
    """Return the selected optimization names, in registry order."""
    valid = registry.names()
    if spec is None or not spec.strip():
        spec = "default"
    selected: set[str] = set()
    for i, item in enumerate(s.strip() for s in spec.split(",")):
        if not item:
            raise FlagError(_msg(spec, f"empty item at position {i + 1}", valid))
        if item in BASES:
            selected = set({"all": valid, "none": [], "default": registry.default_names()}[item])
            continue
        sign, name = (item[0], item[1:].strip()) if item[0] in "+-" else ("", item)
        if not name or not name.replace("_", "").isalnum():
            raise FlagError(_msg(spec, f"malformed item {item!r}", valid))
        if name not in valid:
            raise FlagError(_msg(spec, f"unknown optimization {name!r}", valid))
        (selected.discard if sign == "-" else selected.add)(name)
    return [n for n in valid if n in selected]


def _msg(spec: str, what: str, valid: list[str]) -> str:
    return (
        f"{ENV_FLAG}={spec!r}: {what}. Use 'default', 'all', 'none', or a comma list of names with optional "
        f"+name/-name modifiers (e.g. 'default,-nz_weights' or 'none,+rope'). Valid names: {', '.join(valid)}."
    )


def spec_from_env() -> str:
    return os.environ.get(ENV_FLAG, "default")


def strict_from_env() -> bool:
    return _env.boolean(ENV_STRICT)


force_from_env = fingerprints.forced
