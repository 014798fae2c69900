"""The real ``torch-npu==2.13.0`` wheel as the reference the fake is checked against (read, never installed).

The wheel cannot be imported without CANN (and installing it breaks ``import torch`` on a CPU machine), but its text
files are readable: the op schemas (``npu_native_functions_by_codegen.yaml``), the meta functions
(``op_plugin/meta/_meta_registrations.py``, executed here with stubs for their ``torch_npu`` imports) and
``npu/npu_config.py`` (``_npuConfig``, the class of ``torch.npu.config``).

:func:`fetch` downloads the pinned wheel once (``pip download --no-deps``) into ``VLLM_OMNI_ASCEND_OPT_WHEEL_CACHE``
(default ``~/.cache/vllm-omni-ascend-opt/wheels``) and checks its SHA-256; offline it returns the reason, and the
tests skip with it.
"""

from __future__ import annotations

import ast
import builtins
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

VERSION = "2.13.0"
WHEEL_NAME = f"torch_npu-{VERSION}-cp311-cp311-manylinux_2_28_x86_64.whl"
WHEEL_SHA256 = "0deb809cf447d3fce636ccfdc9c9f874950f1fe76f18f4aaab31e2d345f7dac0"
SCHEMA_YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
META_PY = "torch_npu/op_plugin/meta/_meta_registrations.py"
CONFIG_PY = "torch_npu/npu/npu_config.py"
ENV_CACHE = "VLLM_OMNI_ASCEND_OPT_WHEEL_CACHE"


def cache_dir() -> Path:
    return Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "vllm-omni-ascend-opt" / "wheels")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def fetch() -> tuple[Path | None, str]:
    """(path of the cached wheel, "") or (None, why it is unavailable). Downloads at most once per cache dir."""
    target = cache_dir() / WHEEL_NAME
    if target.is_file() and _sha256(target) == WHEEL_SHA256:
        return target, ""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            cmd = [
                sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
                "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11", "--implementation", "cp",
                "--abi", "cp311", "-q", "-d", tmp, f"torch-npu=={VERSION}",
            ]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
            got = Path(tmp) / WHEEL_NAME
            if proc.returncode != 0 or not got.is_file():
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
                return None, f"pip download torch-npu=={VERSION} failed (exit {proc.returncode}): {tail[0]}"
            digest = _sha256(got)
            if digest != WHEEL_SHA256:
                return None, f"downloaded {WHEEL_NAME} has SHA-256 {digest}, expected {WHEEL_SHA256}"
            shutil.move(str(got), target)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"cannot fetch torch-npu=={VERSION}: {exc.__class__.__name__}: {exc}"
    return target, ""


def read_text(member: str) -> str:
    path, why = fetch()
    if path is None:
        raise FileNotFoundError(why)
    with zipfile.ZipFile(path) as zf:
        return zf.read(member).decode("utf-8")


# ----- schemas --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Arg:
    type: str
    name: str
    default: Any  # _NO_DEFAULT when required
    kw_only: bool


_NO_DEFAULT = object()


class RawDefault(str):
    """A schema default that is not a Python literal (kept as its text)."""


@dataclass(frozen=True)
class Schema:
    name: str  # with overload, e.g. "npu_format_cast" or "npu_format_cast.Tensor"
    args: tuple[Arg, ...]
    returns: tuple[str, ...]
    text: str


def _split_top(s: str) -> list[str]:
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _default(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return RawDefault(text)  # e.g. "Mean", "contiguous_format": not a Python literal


def parse_schema(text: str) -> Schema:
    m = re.fullmatch(r"\s*([\w.]+)\((.*)\)\s*->\s*(.+?)\s*", text)
    if m is None:
        raise ValueError(f"not a schema: {text!r}")
    name, arg_text, ret = m.groups()
    args, kw_only = [], False
    for part in _split_top(arg_text):
        if part == "*":
            kw_only = True
            continue
        decl, _, default = part.partition("=")
        typ, _, arg_name = decl.strip().rpartition(" ")
        args.append(Arg(typ, arg_name, _default(default.strip()) if default else _NO_DEFAULT, kw_only))
    ret = ret.strip()
    returns = tuple(_split_top(ret[1:-1])) if ret.startswith("(") else (ret,)
    return Schema(name, tuple(args), returns, text.strip())


@functools.lru_cache(maxsize=1)
def schemas() -> dict[str, Schema]:
    """Every ``func:`` schema of the yaml by name (with overload); the first one wins for duplicated entries."""
    out: dict[str, Schema] = {}
    for line in read_text(SCHEMA_YAML).splitlines():
        m = re.match(r"\s*-?\s*func:\s*(\S+\(.*\)\s*->.+)$", line)
        if m:
            s = parse_schema(m.group(1))
            out.setdefault(s.name, s)
    return out


# ----- executing the wheel's Python with stubs ------------------------------------------------------------------------
class _Anything:
    """Stands for any attribute chain / call (``torch.ops.npu.x.default``, ``ErrCode.PARAM``)."""

    def __getattr__(self, name: str) -> _Anything:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> _Anything:
        return self

    def __str__(self) -> str:
        return ""


class _TorchProxy(types.ModuleType):
    """``torch`` for the wheel's code: everything real except ``torch.ops`` (the ``npu`` namespace does not exist)."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        if name == "ops":
            return _Anything()
        return getattr(torch, name)


@dataclass
class Stubs:
    """What the wheel's modules see as ``torch_npu``: records ``_C._npu_setOption`` calls in ``options``."""

    cann_version: str = "8.3.RC1"
    soc_version: int = 220  # Ascend910B1; < 260 (Ascend950)

    def __post_init__(self) -> None:
        self.options: dict[str, str] = {}

    def _set_option(self, option: dict[str, str]) -> None:
        self.options.update(option)

    def _get_option(self, name: str) -> bytes | None:
        value = self.options.get(name)
        return None if value is None else value.encode()

    def modules(self) -> dict[str, Any]:
        c = types.SimpleNamespace(_npu_setOption=self._set_option, _npu_getOption=self._get_option)
        # torch_npu's own dtypes, as the enum values the meta functions map them to (npu_quant_matmul reads them)
        dtypes = dict(int4=285, hifloat8=290, float8_e8m0fnu=293, float4_e2m1fn_x2=296, float4_e1m2fn_x2=297)
        empty, none = (lambda *a, **k: ""), (lambda *a, **k: None)
        mods = [
            _module("torch_npu", _C=c, **dtypes),
            _module("torch_npu.utils._error_code", ErrCode=_Anything(), ops_error=empty, pta_error=empty),
            _module("torch_npu.npu.utils", get_cann_version=lambda module="CANN": self.cann_version),
            _module("torch_npu.npu._backends", get_soc_version=lambda: self.soc_version),
            _module("torch_npu.utils._path_manager", PathManager=_Anything()),
            _module("torch.library", Library=none),
            _module("torch.fx.node", has_side_effect=none),
        ]
        return {"torch": _TorchProxy(), "torch_npu._C": c, **{m.__name__: m for m in mods}}


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


def exec_wheel_module(member: str, stubs: Stubs, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Execute one of the wheel's Python files with ``stubs`` for its torch_npu imports; return its globals."""
    table = stubs.modules()
    table.update(extra or {})
    real_import = builtins.__import__

    def _import(name: str, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name in table:
            mod = table[name]
            if fromlist:
                return mod
            return table.get(name.split(".")[0], mod)
        if level == 0 and name.split(".")[0] == "torch_npu":
            raise ImportError(f"reference stubs: {name} is not stubbed")
        return real_import(name, globals, locals, fromlist, level)

    env: dict[str, Any] = {
        "__name__": f"torch_npu_reference.{member}",
        "__builtins__": {**vars(builtins), "__import__": _import},
    }
    exec(compile(read_text(member), member, "exec"), env)
    return env


@functools.lru_cache(maxsize=1)
def meta_functions() -> dict[str, Any]:
    """op name (with overload) -> the wheel's meta function, as registered by ``@impl(m, "name")``."""
    registered: dict[str, Any] = {}

    def impl(_lib: Any, name: str, *a: Any, **k: Any) -> Any:
        def deco(fn: Any) -> Any:
            registered.setdefault(name, fn)
            return fn

        return deco

    lib = _module("torch.library", Library=lambda *a, **k: None, impl=impl)
    exec_wheel_module(META_PY, Stubs(), {"torch.library": lib})
    return registered


def real_npu_config() -> tuple[Any, Stubs]:
    """A fresh instance of the wheel's ``_npuConfig`` (``torch.npu.config``) and the stubs recording its options."""
    stubs = Stubs()
    env = exec_wheel_module(CONFIG_PY, stubs)
    return env["_npuConfig"](), stubs
