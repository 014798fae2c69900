"""``vllm-omni-ascend-opt compare A B``: two reference sets (or a set and an ablation output) image by image, paired
by key, gated by tier; the reports are written only once everything was compared."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from vllm_omni_ascend_opt.ablation import compare
from vllm_omni_ascend_opt.ablation import refset as _refset
from vllm_omni_ascend_opt.ablation.refset import MAY_DIFFER, MUST_MATCH, RefSet, SetError
from vllm_omni_ascend_opt.ablation.report import atomic_write, table_head, write_json

TIERS = ("exact", "pixel", "close")
WITHIN, OUTSIDE, NOTHING = 0, 1, 2
#: Worst pairs drawn in compare.png, and the most their difference map is amplified (its largest difference: white).
WORST_SHOWN = 4
MAX_AMPLIFY = 64.0


def check_manifests(a: RefSet, b: RefSet) -> list[dict[str, Any]]:
    """Raise :class:`SetError` on the first :data:`MUST_MATCH` fact that differs; else the :data:`MAY_DIFFER` ones."""
    fa, fb = a.facts(), b.facts()
    for name in MUST_MATCH:
        if fa[name] != fb[name]:
            raise SetError(
                f"{a.root} and {b.root} disagree on {name}: {fa[name]!r} vs {fb[name]!r}; images made with a "
                f"different {name} are not comparable (nothing compared)"
            )
    return [{"field": k, "a": fa[k], "b": fb[k], "same": fa[k] == fb[k]} for k in MAY_DIFFER]


def compare_pair(ea: Any, eb: Any) -> dict[str, Any]:
    """Every metric of ``eb`` against ``ea`` (uint8 images; tensors when both sides have them)."""
    ua, ub = compare.read_png(ea.png), compare.read_png(eb.png)
    if ua.shape != ub.shape:
        raise SetError(
            f"{ea.png} and {eb.png}: images of different sizes ({ua.shape[1]}x{ua.shape[0]} vs "
            f"{ub.shape[1]}x{ub.shape[0]}) under one key ({ea.key_text()})"
        )
    m = compare.compare(compare.StoredImage(ua, None), compare.StoredImage(ub, None))
    tensors = None
    if ea.tensor is not None and eb.tensor is not None:
        ta, tb = np.load(ea.tensor), np.load(eb.tensor)
        if ta.shape != tb.shape:
            raise SetError(f"{ea.tensor} and {eb.tensor}: tensors of different shapes {ta.shape} vs {tb.shape}")
        a64, b64 = ta.astype(np.float64), tb.astype(np.float64)
        denom = float(np.linalg.norm(a64))
        tensors = {
            "bitwise_identical": bool(np.array_equal(ta, tb)),
            "max_abs": float(np.abs(a64 - b64).max()),
            "rel_error": float(np.linalg.norm(a64 - b64) / denom) if denom else (0.0 if not b64.any() else math.inf),
        }
        m["bitwise_identical"] = tensors["bitwise_identical"]
    return {"id_a": ea.id, "id_b": eb.id, "key": ea.key, **m, "tensors": tensors}


def gate(pairs: list[dict[str, Any]], tier: str, ssim_gate: float, psnr_gate: float) -> dict[str, Any]:
    """The tier's gate on the worst case over ``pairs`` (:func:`.compare.gate`, the ablation runner's)."""
    # a pair's bitwise_identical is its tensors' (None without both): the exact tier then falls back to pixels
    agg = compare.aggregate({p["id_a"]: {k: p[k] for k in compare.METRIC_KEYS} for p in pairs})
    return {"worst": agg, **compare.gate(agg, tier, ssim_gate, psnr_gate)}


def run_compare(
    a: RefSet, b: RefSet, *, tier: str = "close", ssim_gate: float = 0.99, psnr_gate: float = 35.0
) -> dict[str, Any]:
    """The comparison as a JSON-able dict, with ``exit_code``. Raises :class:`SetError` on bad input."""
    if tier not in TIERS:
        raise SetError(f"--tier {tier!r}: use one of {', '.join(TIERS)}")
    facts = check_manifests(a, b)
    both = [k for k in a.entries if k in b.entries]
    only_a = [a.entries[k] for k in a.entries if k not in b.entries]
    only_b = [b.entries[k] for k in b.entries if k not in a.entries]
    pairs = [compare_pair(a.entries[k], b.entries[k]) for k in both]
    result: dict[str, Any] = {
        "a": {"path": str(a.root), "kind": a.kind},
        "b": {"path": str(b.root), "kind": b.kind},
        "facts": facts,
        "tier": tier,
        "gates": {"ssim": ssim_gate, "psnr_db": psnr_gate},
        "pairs": pairs,
        "only_in_a": [{"id": e.id, "key": e.key} for e in only_a],
        "only_in_b": [{"id": e.id, "key": e.key} for e in only_b],
    }
    if not pairs:
        result.update(gate=None, exit_code=NOTHING, verdict="nothing compared: no key is in both")
        return result
    g = gate(pairs, tier, ssim_gate, psnr_gate)
    result["gate"] = g
    identical = sum(p["pixel_identical"] for p in pairs)
    result["summary"] = {"pairs": len(pairs), "pixel_identical": identical}
    result["exit_code"] = WITHIN if g["passed"] else OUTSIDE
    one_side = f"; {len(only_a) + len(only_b)} key(s) on one side only" if only_a or only_b else ""
    result["verdict"] = (
        f"{'within' if g['passed'] else 'OUTSIDE'} the {tier} gate: {g['why']} ({identical}/{len(pairs)} pairs "
        f"pixel-identical{one_side})"
    )
    return result


def summary_rows(res: dict[str, Any]) -> list[list[str]]:
    """One row per pair, worst first, in :data:`HEAD`'s columns."""
    rows = []
    for p in worst_first(res["pairs"]):
        t = p["tensors"]
        tensor = (
            "–" if t is None else "bitwise" if t["bitwise_identical"] else f"{t['max_abs']:.3g} / {t['rel_error']:.3g}"
        )
        pixel = "yes" if p["pixel_identical"] else "no"
        rows.append(
            [p["id_a"], pixel, f"{p['max_abs_diff']:.3g}", compare.fmt_db(p["psnr_db"]), f"{p['ssim']:.4f}", tensor]
        )
    return rows


HEAD = ["image", "pixel-identical", "max abs diff", "PSNR", "SSIM", "tensor max abs / rel"]


def worst_first(pairs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(pairs, key=lambda p: (p["pixel_identical"], p["ssim"], p["psnr_db"]))


def markdown(res: dict[str, Any]) -> str:
    lines = [
        "# Comparison of two image sets",
        "",
        f"- A: `{res['a']['path']}` ({res['a']['kind']})",
        f"- B: `{res['b']['path']}` ({res['b']['kind']})",
        "",
        f"**{res['verdict']}** (exit code {res['exit_code']})",
        "",
        "## What differs between the two (allowed)",
        "",
        "| field | A | B |",
        "|---|---|---|",
    ]
    lines += [f"| {f['field']}{'' if f['same'] else ' ⚠'} | {f['a']} | {f['b']} |" for f in res["facts"]]
    lines += [
        "",
        f"## Pairs (tier {res['tier']}; close gates SSIM ≥ {res['gates']['ssim']}, PSNR ≥ "
        f"{res['gates']['psnr_db']} dB)",
        "",
        *table_head(HEAD),
    ]
    lines += ["| " + " | ".join(r) + " |" for r in summary_rows(res)]
    for side in ("a", "b"):
        only = res[f"only_in_{side}"]
        if only:
            lines += ["", f"## Only in {side.upper()} ({len(only)}, not compared)", ""]
            lines += [f"- `{o['id']}`: {json.dumps(o['key'])}" for o in only]
    lines += [
        "",
        "max abs diff is in [-1, 1] units on the 8-bit images (2/255 = one level); PSNR and SSIM on the 8-bit images. "
        "`compare.png`: the worst pairs, A | B | |A − B| amplified "
        f"{res.get('png_amplify', 1):g}x.",
        "",
    ]
    return "\n".join(lines)


def write_png(res: dict[str, Any], a: RefSet, b: RefSet, path: Path) -> None:
    """The worst pairs as rows of A, B and their difference amplified to white (by ``res["png_amplify"]``)."""
    from PIL import Image

    worst = worst_first(res["pairs"])[:WORST_SHOWN]
    by_a = {e.id: e for e in a.entries.values()}
    by_b = {e.id: e for e in b.entries.values()}
    imgs = [(compare.read_png(by_a[p["id_a"]].png), compare.read_png(by_b[p["id_b"]].png)) for p in worst]
    diffs = [np.abs(ia.astype(np.int16) - ib.astype(np.int16)) for ia, ib in imgs]
    top = max(int(d.max()) for d in diffs)
    amp = min(MAX_AMPLIFY, 255.0 / top) if top else 1.0
    shown = [np.clip(d * amp, 0, 255).astype(np.uint8) for d in diffs]
    rows = [np.concatenate([ia, ib, ds], axis=1) for (ia, ib), ds in zip(imgs, shown, strict=True)]
    width = max(r.shape[1] for r in rows)
    grid = np.concatenate([np.pad(r, ((0, 2), (0, width - r.shape[1]), (0, 0))) for r in rows], axis=0)
    scale = max(1, math.ceil(128 / min(r.shape[0] for r in rows)))  # at least 128 px high
    im = Image.fromarray(grid)
    im.resize((im.width * scale, im.height * scale), Image.NEAREST).save(path)
    res["png_amplify"] = round(amp, 1)


def write(res: dict[str, Any], a: RefSet, b: RefSet, out: Path) -> dict[str, Path]:
    """compare.json, compare.md and (with pairs) compare.png in ``out``, each written atomically."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    if res["pairs"]:
        paths["png"] = atomic_write(out / "compare.png", lambda tmp: write_png(res, a, b, tmp))
    return {
        "json": write_json(out / "compare.json", res),
        "markdown": atomic_write(out / "compare.md", markdown(res)),
        **paths,
    }


def against_reference(path: Path, out_root: Path, plan: Any, environment: dict[str, Any]) -> dict[str, Any]:
    """results.json's ``reference``: every configuration in ``out_root`` against the set at ``path`` (close gates)."""
    wl = plan.workload
    ref = _refset.load(path)
    out: dict[str, Any] = {"path": str(path), "gates": {"ssim": wl.ssim_gate, "psnr_db": wl.psnr_gate}, "configs": {}}
    for c in plan.configs:
        try:
            mine = _refset.load(out_root, c.id)
            mine.manifest["environment"] = environment
            res = run_compare(ref, mine, tier="close", ssim_gate=wl.ssim_gate, psnr_gate=wl.psnr_gate)
        except SetError as exc:
            out["configs"][c.id] = {"error": str(exc)}
            continue
        out.setdefault("differs", [f for f in res["facts"] if not f["same"] and f["field"] != "created"])
        w = (res.get("gate") or {}).get("worst") or {}
        out["configs"][c.id] = {
            "passed": (res.get("gate") or {}).get("passed"),
            "pairs": len(res["pairs"]),
            "pixel_identical": sum(p["pixel_identical"] for p in res["pairs"]),
            "ssim_min": w.get("ssim_min"),
            "psnr_db_min": w.get("psnr_db_min"),
            "only_in_reference": len(res["only_in_a"]),
            "only_here": len(res["only_in_b"]),
            "verdict": res["verdict"],
        }
    return out
