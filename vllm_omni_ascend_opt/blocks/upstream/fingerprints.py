"""The upstream code each optimization relies on, recognised by its source, not by a version string: each declares
the functions it patches, replaces or mirrors (:class:`Upstream`) and stays off where one differs (:func:`reasons`).

A fingerprint is 16 hex digits of the SHA-256 of ``textwrap.dedent(inspect.getsource(fn))``, read from the source file
without importing; an imported function must also be the one defined there (:func:`replacement`). To add a release,
run ``python tools/fingerprints.py`` with it and redo the exactness argument of each function that differs.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import os
import sys
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from vllm_omni_ascend_opt import _backend, _env

ABSENT = "absent"  # the fingerprint of a function the module (or class) does not define itself
V030, V031, V032 = "0.30.0", "0.31.0rc1", "0.32.0rc1"
#: The vLLM-Omni releases the fingerprints were taken from, oldest first (ALL: a function the same in each).
KNOWN_OMNI: tuple[str, ...] = (V030, V031, V032)
ALL = KNOWN_OMNI
MIN_OMNI = (0, 30)  # older releases are refused by version (``_state``)
ENV_FORCE = "VLLM_OMNI_ASCEND_OPT_FORCE"
PLATFORMS = ("cpu", "cuda", "rocm", "npu", "musa")  # as :func:`current_platform` names them
QWEN_IMAGE_21_PACKAGE = "vllm_omni.diffusion.models.qwen_image_21"
_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def forced() -> bool:
    """``VLLM_OMNI_ASCEND_OPT_FORCE`` is set: install although upstream code differs."""
    return _env.boolean(ENV_FORCE)


@dataclass(frozen=True)
class Upstream:
    """One upstream function: ``known`` maps a fingerprint (or :data:`ABSENT`) to the releases that ship it;
    ``platforms`` limits the check to where vLLM-Omni dispatches to it (empty: everywhere)."""

    module: str
    qualname: str
    known: Mapping[str, tuple[str, ...]]
    platforms: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        bad = set(self.platforms) - set(PLATFORMS)
        if bad or not self.known:
            raise ValueError(f"{self.qualname}: bad declaration (platforms {sorted(bad)}, known {dict(self.known)})")

    @property
    def name(self) -> str:
        """``module:qualname`` (the module without vLLM-Omni's package prefix)."""
        return f"{self.module.removeprefix('vllm_omni.')}:{self.qualname}"

    def versions(self) -> tuple[str, ...]:
        """Every release whose code this declaration knows, in :data:`KNOWN_OMNI` order."""
        seen = {v for vs in self.known.values() for v in vs}
        return tuple(v for v in KNOWN_OMNI if v in seen) + tuple(sorted(seen - set(KNOWN_OMNI)))


def same(module: str, qualname: str, fp: str, platforms: tuple[str, ...] = ()) -> Upstream:
    """A function whose source is ``fp`` in every known release."""
    return Upstream(module, qualname, {fp: ALL}, platforms)


@dataclass(frozen=True)
class Finding:
    """What :func:`check` found for one declaration (``replaced``: why the live function is not the source's)."""

    decl: Upstream
    fingerprint: str
    matches: tuple[str, ...]
    applies: bool = True
    replaced: str = ""

    @property
    def ok(self) -> bool:
        return not self.applies or (bool(self.matches) and not self.replaced)

    def reason(self, owner: str) -> str:
        """Why ``owner`` stays off because of this finding."""
        d = self.decl
        where = f" (on {', '.join(d.platforms)})" if d.platforms else ""
        known = ", ".join(d.versions())
        if self.replaced:
            return f"upstream {d.qualname}{where} is replaced at run time ({d.module}): {self.replaced}"
        if self.fingerprint == ABSENT:
            return f"upstream {d.qualname}{where} is missing from {d.module}: {owner} knows it from vLLM-Omni {known}"
        return (
            f"upstream {d.qualname}{where} differs from the code {owner} knows (vLLM-Omni {known}): "
            f"source fingerprint {self.fingerprint} in {d.module}, known {', '.join(d.known)}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "function": self.decl.name,
            "fingerprint": self.fingerprint,
            "matches": list(self.matches),
            "checked": self.applies,
            "platforms": list(self.decl.platforms),
            "replaced": self.replaced,
            "ok": self.ok,
        }


def check(decls: Iterable[Upstream], platform: str | None = None) -> list[Finding]:
    """One :class:`Finding` per declaration, for ``platform`` (default: :func:`current_platform`)."""
    platform = platform or current_platform()
    out = []
    for d in decls:
        applies = not d.platforms or platform in d.platforms
        fp = fingerprint(d.module, d.qualname)
        matches = tuple(d.known.get(fp, ()))
        out.append(Finding(d, fp, matches, applies, replacement(d.module, d.qualname) if applies else ""))
    return out


def reasons(decls: Iterable[Upstream], owner: str, platform: str | None = None) -> list[str]:
    """Why ``owner`` cannot trust the upstream code it declares (empty: every function matches a known fingerprint)."""
    return [f.reason(owner) for f in check(decls, platform) if not f.ok]


def summary(findings: list[Finding]) -> str:
    """One line for ``list``: how many declared functions match, and the releases whose code all of them match."""
    checked = [f for f in findings if f.applies]
    good = [f for f in checked if f.ok]
    seen = {v for f in good for v in f.matches}
    common = [v for v in (*KNOWN_OMNI, *sorted(seen - set(KNOWN_OMNI))) if all(v in f.matches for f in good)]
    line = f"{len(good)}/{len(checked)} upstream functions match a known fingerprint"
    if good and len(good) == len(checked):
        line += f" (as in vLLM-Omni {', '.join(common)})" if common else " (each as in some known release)"
    if skipped := len(findings) - len(checked):
        line += f"; {skipped} not checked on {current_platform()} (other platforms' code paths)"
    return line


def module_file(module: str) -> Path | None:
    """The source file of ``module`` without importing it or its parents (its ``__file__`` when imported), or None."""
    mod = sys.modules.get(module)
    if mod is not None and getattr(mod, "__file__", None):
        return Path(mod.__file__)
    top, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: nothing is imported
    except (ImportError, ValueError):
        spec = None
    if spec is None or not rest:
        return Path(spec.origin) if spec and spec.origin and spec.origin.endswith(".py") else None
    for loc in spec.submodule_search_locations or ():
        for p in (Path(loc, *rest[:-1], rest[-1] + ".py"), Path(loc, *rest, "__init__.py")):
            if p.is_file():
                return p
    return None


def fingerprint(module: str, qualname: str) -> str:
    """The fingerprint of ``module.qualname``'s source, :data:`ABSENT` or ``unreadable: ...``."""
    if (path := module_file(module)) is None:
        return f"unreadable: module {module} not found"
    try:
        return _SourceIndex.of(path).fingerprint(qualname)
    except (OSError, SyntaxError, ValueError) as exc:
        return f"unreadable: {exc.__class__.__name__}: {exc}"


class _SourceIndex:
    """A parsed source file, kept while its size and modification time stay the same."""

    _cache: ClassVar[dict[str, tuple[tuple[int, int], _SourceIndex]]] = {}

    def __init__(self, text: str) -> None:
        self.tree = ast.parse(text)
        self.lines = text.splitlines(keepends=True)

    @classmethod
    def of(cls, path: Path) -> _SourceIndex:
        st = path.stat()
        key = (st.st_mtime_ns, st.st_size)
        hit = cls._cache.get(str(path))
        if hit is None or hit[0] != key:
            hit = cls._cache[str(path)] = (key, cls(path.read_text(encoding="utf-8")))
        return hit[1]

    def first_line(self, qualname: str) -> int | None:
        body: list[ast.stmt] = self.tree.body
        for part in qualname.split("."):
            defs = [n for n in _statements(body) if isinstance(n, _DEFINITIONS) and n.name == part]
            if not defs:
                return None
            node = defs[-1]  # the last definition wins, as when the body executes
            body = node.body  # type: ignore[attr-defined]
        return min([node.lineno] + [d.lineno for d in node.decorator_list])  # type: ignore[attr-defined]

    def fingerprint(self, qualname: str) -> str:
        start = self.first_line(qualname)
        if start is None:
            return ABSENT
        # the very lines inspect.getsource returns (getsourcelines: getblock from the first line)
        src = textwrap.dedent("".join(inspect.getblock(self.lines[start - 1 :])))
        return hashlib.sha256(src.encode()).hexdigest()[:16]


def _statements(body: list[ast.stmt]) -> Iterable[ast.stmt]:
    """Statements of a module or class body, including those in ``if`` / ``try`` blocks."""
    for n in body:
        if isinstance(n, ast.If):
            yield from _statements(n.body)
            yield from _statements(n.orelse)
        elif isinstance(n, ast.Try):
            for part in (n.body, *(h.body for h in n.handlers), n.orelse, n.finalbody):
                yield from _statements(part)
        else:
            yield n


def fully_imported(module_name: str) -> bool:
    """``module_name`` is in ``sys.modules`` and has finished executing."""
    mod = sys.modules.get(module_name)
    return mod is not None and not getattr(getattr(mod, "__spec__", None), "_initializing", False)


def live(module: str, qualname: str) -> tuple[bool, Any]:
    """``(found, object)``: ``module.qualname`` in the imported module's or class's own ``__dict__``."""
    obj: Any = sys.modules[module]
    *owners, name = qualname.split(".")
    for part in owners:
        obj = vars(obj).get(part)
        if obj is None:
            return False, None
    return (True, vars(obj)[name]) if name in vars(obj) else (False, None)


def replacement(module: str, qualname: str) -> str:
    """Why the imported ``module.qualname`` (unwrapped) is not the function its source defines ("": it is)."""
    if not fully_imported(module):
        return ""
    try:
        found, obj = live(module, qualname)
    except TypeError:  # an owner without __dict__
        return f"{qualname} is not a class attribute here"
    path = module_file(module)
    try:  # the first line of its definition (first decorator included)
        line = None if path is None else _SourceIndex.of(path).first_line(qualname)
    except (OSError, SyntaxError, ValueError):
        line = None
    if not found:
        return "" if line is None else f"{qualname} is defined in the source but missing on the imported module"
    if line is None:
        return f"{qualname} is not defined in {module}'s source but set on the imported module"
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    fn = inspect.unwrap(obj) if callable(obj) else obj
    if (code := getattr(fn, "__code__", None)) is None:
        return f"{qualname} is a {type(fn).__name__}, not a Python function"
    same_file = path is not None and os.path.realpath(code.co_filename) == os.path.realpath(path)
    if not same_file or code.co_firstlineno != line:
        return f"it is {getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
    return ""


def current_platform() -> str:
    """The platform vLLM-Omni dispatches ``CustomOp``s for here: ``npu``, ``rocm``, ``cuda``, ``musa`` or ``cpu``."""
    if _backend.torch_npu_module() is not None:
        return "npu"
    if torch.cuda.is_available():
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    musa = getattr(torch, "musa", None)
    if musa is not None and getattr(musa, "is_available", lambda: False)():
        return "musa"
    return "cpu"


def qwen_image_21(model: Any) -> str | None:
    """The class name when ``model`` is (or holds as ``.transformer`` / ``.vae``) a piece of Qwen-Image-2.1."""
    for obj in (model, getattr(model, "transformer", None), getattr(model, "vae", None)):
        for cls in type(obj).__mro__:  # (None: NoneType, never a match)
            if cls.__module__.startswith(QWEN_IMAGE_21_PACKAGE + "."):
                return type(obj).__name__ if obj is model else f"{type(model).__name__} ({cls.__name__})"
    return None
