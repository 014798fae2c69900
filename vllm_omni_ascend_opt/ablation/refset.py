"""Reference sets: a workload's images with a ``manifest.json`` of what made them and every file's SHA-256, to compare
across machines, releases and configurations (docs/ablation.md, "Comparing machines and releases")."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
FORMAT = "vllm-omni-ascend-opt reference set"
#: Key fields of an image, in the order they are shown.
KEY_FIELDS = ("prompt", "negative_prompt", "seed", "width", "height", "steps", "cfg_scale", "input_image_sha256")
#: Manifest facts two compared sets must share (an error naming the field otherwise): what makes the images the
#: same images. Sizes, steps and seeds are compared as the sets of values the images use.
MUST_MATCH = ("model", "weights", "pipeline", "size", "steps", "seed")
#: Facts read from the manifest's environment by the same name.
ENV_FACTS = ("cann", "torch_npu", "cuda", "torch", "diffusers", "vllm", "vllm_omni", "vllm_omni_ascend_opt")
#: Facts that may legitimately differ, shown side by side at the top of a comparison.
MAY_DIFFER = ("config", "optimizations", "dtype", "engine", "device", "chip", *ENV_FACTS, "created")


class SetError(ValueError):
    """A reference set (or ablation output) that cannot be used; the message names the file (exit code 2)."""


@dataclass
class Entry:
    """One image of a set: its key, its files (absolute paths) and their expected SHA-256."""

    id: str
    key: dict[str, Any]
    png: Path
    tensor: Path | None = None

    def key_tuple(self) -> tuple[Any, ...]:
        return tuple(json.dumps(self.key.get(k), sort_keys=True) for k in KEY_FIELDS)

    def key_text(self) -> str:
        k = self.key
        img = f", input {str(k['input_image_sha256'])[:12]}" if k.get("input_image_sha256") else ""
        return (
            f"{k['prompt'][:40]!r} seed {k['seed']} {k['width']}x{k['height']} {k['steps']} steps CFG "
            f"{k['cfg_scale']}{img}"
        )


@dataclass
class RefSet:
    """A loaded, checked set: its root, manifest, entries by key, and what it is (``set`` or ``ablation:<config>``)."""

    root: Path
    manifest: dict[str, Any]
    entries: dict[tuple[Any, ...], Entry] = field(default_factory=dict)
    kind: str = "set"

    def facts(self) -> dict[str, Any]:
        """The manifest's facts by :data:`MUST_MATCH` / :data:`MAY_DIFFER` name."""
        m, env = self.manifest, self.manifest.get("environment") or {}
        dev = env.get("device") or {}
        keys = [e.key for e in self.entries.values()]
        return {
            "model": (m.get("model") or {}).get("id"),
            "weights": (m.get("model") or {}).get("weights"),
            "pipeline": (m.get("model") or {}).get("pipeline"),
            "size": sorted({f"{k['width']}x{k['height']}" for k in keys}),
            "steps": sorted({k["steps"] for k in keys}),
            "seed": sorted({k["seed"] for k in keys}),
            "config": (m.get("config") or {}).get("name"),
            "optimizations": ", ".join((m.get("config") or {}).get("optimizations") or []) or "(none)",
            "dtype": (m.get("workload") or {}).get("dtype"),
            "engine": (m.get("workload") or {}).get("engine"),
            "device": dev.get("type"),
            "chip": dev.get("name"),
            **{k: env.get(k) for k in ENV_FACTS},
            "created": m.get("created"),
        }


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def input_image_sha256(spec: str | None) -> str | None:
    """SHA-256 of an edit pipeline's input image as the pipeline receives it (RGB pixels and size), or None."""
    if not spec:
        return None
    from vllm_omni_ascend_opt.ablation.engines import input_image

    im = input_image(spec)
    h = hashlib.sha256(f"{im.width}x{im.height}:".encode())
    h.update(im.tobytes())
    return h.hexdigest()


def model_identity(workload: Any, model_path: str | None) -> dict[str, Any]:
    """Model id, weights hash (tiny model key, SHA-256 of a local directory's weight files, else None), pipeline."""
    pipeline = None
    if model_path and (Path(model_path) / "model_index.json").is_file():
        with contextlib.suppress(OSError, ValueError):
            pipeline = json.loads((Path(model_path) / "model_index.json").read_text()).get("_class_name")
    if workload.is_tiny:
        weights = f"testbed:{workload.tiny_spec().key(0)}"
    elif model_path and Path(model_path).is_dir():
        h = hashlib.sha256()
        files = sorted(
            p for p in Path(model_path).rglob("*") if p.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf")
        )
        for p in files:
            h.update(f"{p.relative_to(model_path)}:{sha256_file(p)}\n".encode())
        weights = f"sha256:{h.hexdigest()}" if files else None
    else:
        weights = None
    return {"id": workload.model, "path": model_path, "weights": weights, "pipeline": pipeline}


def entry_id(prompt: int, seed: int, width: int, height: int) -> str:
    return f"p{prompt}_s{seed}_{width}x{height}"


def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise SetError(f"{path}: no {what} (not a reference set or ablation output?)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise SetError(f"{path}: corrupt {what}: {exc}") from None
    if not isinstance(data, dict):
        raise SetError(f"{path}: corrupt {what}: not a JSON object")
    return data


def load(path: Path | str, config: str | None = None) -> RefSet:
    """The checked reference set at ``path``, or configuration ``config`` (default full) of an ablation output."""
    root = Path(path)
    if not root.is_dir():
        raise SetError(f"{root}: no such directory")
    if not (root / MANIFEST).exists() and (root / "plan.json").is_file():
        return load_ablation(root, config or "full")
    m = _read_json(root / MANIFEST, "manifest")
    if m.get("format") != FORMAT:
        raise SetError(f"{root / MANIFEST}: corrupt manifest: 'format' is not {FORMAT!r}")
    if m.get("version") != MANIFEST_VERSION:
        raise SetError(
            f"{root / MANIFEST}: unknown manifest version {m.get('version')!r} (this vllm-omni-ascend-opt reads "
            f"version {MANIFEST_VERSION}; a newer release wrote it?)"
        )
    files, images = m.get("files"), m.get("images")
    if not isinstance(files, dict) or not isinstance(images, list):
        raise SetError(f"{root / MANIFEST}: corrupt manifest: 'files' and 'images' are missing")
    for rel, want in files.items():
        p = root / rel
        if not p.is_file():
            raise SetError(f"{p}: listed in {root / MANIFEST} but missing")
        got = sha256_file(p)
        if got != want:
            raise SetError(f"{p}: SHA-256 {got[:16]}… does not match the manifest's {str(want)[:16]}… (changed?)")
    out = RefSet(root, m)
    for item in images:
        try:
            tensor = root / item["tensor"] if item.get("tensor") else None
            e = Entry(item["id"], dict(item["key"]), root / item["png"], tensor)
            if item["png"] not in files or (item.get("tensor") and item["tensor"] not in files):
                raise KeyError("a file without its SHA-256")
            missing = [k for k in KEY_FIELDS if k not in e.key]
            if missing:
                raise KeyError(f"key without {', '.join(missing)}")
        except (KeyError, TypeError) as exc:
            raise SetError(f"{root / MANIFEST}: corrupt manifest: image entry {item!r:.80}: {exc}") from None
        if e.key_tuple() in out.entries:
            raise SetError(f"{root / MANIFEST}: corrupt manifest: two images under one key ({e.key_text()})")
        out.entries[e.key_tuple()] = e
    return out


def load_ablation(root: Path, config: str) -> RefSet:
    """Configuration ``config`` of the ablation output ``root`` as a set (keys from plan.json)."""
    from vllm_omni_ascend_opt.ablation.workload import from_mapping

    plan = _read_json(root / "plan.json", "ablation plan")
    results = _read_json(root / "results.json", "ablation results") if (root / "results.json").exists() else {}
    try:
        wl = from_mapping({k: v for k, v in plan["workload"].items() if k != "name"}, name=plan["workload"]["name"])
        cfg = next((c for c in plan["configs"] if c["id"] == config), None)
    except (KeyError, TypeError, ValueError) as exc:
        raise SetError(f"{root / 'plan.json'}: corrupt ablation plan: {exc}") from None
    if cfg is None:
        ids = ", ".join(c["id"] for c in plan["configs"])
        raise SetError(f"{root / 'plan.json'}: the ablation has no configuration {config!r} (it has {ids})")
    manifest = _manifest(results.get("created"), plan["workload"], model_identity(wl, plan.get("model_path")))
    manifest["config"] = {"name": config, "spec": cfg["spec"], "optimizations": cfg["opts"]}
    out = RefSet(root, {**manifest, "environment": results.get("environment") or {}}, kind=f"ablation:{config}")
    img_hash = input_image_sha256(wl.image)
    for p, prompt in enumerate(wl.prompts):
        for s in wl.seeds:
            stem = root / "images" / config / f"p{p}_s{s}"
            if not stem.with_suffix(".png").is_file():
                continue
            npy = stem.with_suffix(".npy")
            e = Entry(entry_id(p, s, wl.width, wl.height), _key(wl, prompt, s, img_hash), stem.with_suffix(".png"))
            e.tensor = npy if npy.is_file() else None
            out.entries[e.key_tuple()] = e
    return out


def _manifest(created: str | None, workload: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "version": MANIFEST_VERSION, "created": created, "workload": workload, "model": model}


def _key(wl: Any, prompt: str, seed: int, img_hash: str | None) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "negative_prompt": wl.negative_prompt if wl.cfg_scale > 1 else None,
        "seed": seed,
        "width": wl.width,
        "height": wl.height,
        "steps": wl.steps,
        "cfg_scale": float(wl.cfg_scale),
        "input_image_sha256": img_hash,
    }


def check_out_dir(out: Path, fresh: bool) -> None:
    """Refuse an output directory that holds a set (or anything else) unless ``fresh``."""
    if out.exists() and not fresh:
        if (out / MANIFEST).exists():
            raise SetError(f"{out}: already holds a reference set ({out / MANIFEST}); --fresh replaces it")
        if not out.is_dir() or any(out.iterdir()):
            raise SetError(f"{out}: exists and is not an empty directory; choose another --out (or --fresh)")


def save(
    plan: Any,
    config: Any,
    out: Path,
    *,
    tensors: bool = False,
    fresh: bool = False,
    worker_cmd: list[str] | None = None,
    log: Any = None,
) -> RefSet:
    """Generate ``plan``'s images with ``config`` in one worker; the set is renamed into ``out`` only when complete."""
    from vllm_omni_ascend_opt.ablation.processes import WorkerFailed
    from vllm_omni_ascend_opt.ablation.runner import Runner

    out = Path(out)
    check_out_dir(out, fresh)
    wl = plan.workload
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    say = log or (lambda msg: None)
    runner = Runner(plan, tmp, progress=False, worker_cmd=worker_cmd, log=say)
    w = None
    try:
        w = runner.spawn(config)
        ready = w.wait_ready(wl.start_timeout_s)
        img_hash = input_image_sha256(wl.image)
        images, files = [], {}
        for p, s in plan.samples:
            eid = entry_id(p, s, wl.width, wl.height)
            stem = tmp / "images" / eid
            w.run(p, s, str(stem), wl.timeout_s)
            say(f"  {eid}")
            npy = stem.with_suffix(".npy")
            if npy.is_file() and not tensors:
                npy.unlink()
            item = {"id": eid, "key": _key(wl, wl.prompts[p], s, img_hash), "png": f"images/{eid}.png"}
            item["tensor"] = f"images/{eid}.npy" if npy.is_file() else None
            for rel in filter(None, (item["png"], item["tensor"])):
                files[rel] = sha256_file(tmp / rel)
            images.append(item)
    except BaseException as exc:
        tail = w.log_tail(20) if w is not None else ""
        if w is not None:
            w.kill()
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, WorkerFailed):
            raise SetError(f"{out}: generating the set failed ({exc.phase}): {exc.error}\n{tail}") from None
        raise
    w.stop()
    shutil.rmtree(tmp / "configs", ignore_errors=True)  # the job file and worker log of a finished set
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    manifest = {
        **_manifest(created, {**wl.to_dict(), "engine": plan.engine}, model_identity(wl, plan.model_path)),
        "config": {"name": config.label, "spec": config.spec, "optimizations": list(config.opts)},
        "environment": ready.get("env") or {},
        "images": images,
        "files": files,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return load(out)
