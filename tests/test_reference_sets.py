"""``reference save`` and ``compare`` through the fake worker (tests/ablation_fake_worker.py): pairing by key, gates,
manifest facts, and every bad input (one clear error naming the file, nothing written)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vllm_omni_ascend_opt.ablation import refcli, refset, setcompare
from vllm_omni_ascend_opt.cli import build_parser, main

FAKE = [sys.executable, str(Path(__file__).with_name("ablation_fake_worker.py"))]


def save(tmp_path: Path, name: str, *extra: str, fake: list[str] | None = FAKE, model="tiny") -> tuple[int, Path]:
    wl = tmp_path / f"wl-{name}.json"
    wl.write_text(json.dumps({"model": model, "height": 16, "width": 16, "steps": 2, "seeds": [1, 2]}))
    out = tmp_path / name
    args = build_parser().parse_args(["reference", "save", "--workload", str(wl), "--out", str(out), *extra])
    return refcli.cmd_reference_save(args, worker_cmd=fake), out


def compare(a: Path, b: Path, out: Path, *extra: str) -> tuple[int, dict | None]:
    rc = main(["compare", str(a), str(b), "--out", str(out), *extra])
    res = json.loads((out / "compare.json").read_text()) if (out / "compare.json").exists() else None
    return rc, res


def edit_manifest(root: Path, change) -> None:
    """Change the manifest (``change(manifest)``) and re-hash every file, as another writer would have."""
    path = root / refset.MANIFEST
    m = json.loads(path.read_text())
    change(m)
    m["files"] = {rel: refset.sha256_file(root / rel) for rel in m["files"] if (root / rel).exists()}
    path.write_text(json.dumps(m))


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """One set (with tensors) for the module's tests, which copy it before they change anything."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ABLATION_FAKE", "{}")
        rc, out = save(tmp_path_factory.mktemp("ref"), "ref", "--tensors")
    assert rc == 0
    return out


@pytest.fixture(autouse=True)
def _fake_env(monkeypatch):
    monkeypatch.setenv("ABLATION_FAKE", "{}")


def test_a_set_holds_its_manifest_and_matches_itself_exactly(ref, capsys, tmp_path):
    m = json.loads((ref / refset.MANIFEST).read_text())
    assert m["version"] == refset.MANIFEST_VERSION and m["created"]
    assert [i["id"] for i in m["images"]] == ["p0_s1_16x16", "p0_s2_16x16"]
    key = m["images"][0]["key"]
    assert (key["seed"], key["width"], key["height"], key["steps"], key["cfg_scale"]) == (1, 16, 16, 2, 1.0)
    assert key["prompt"] and key["input_image_sha256"] is None
    assert set(m["files"]) == {f"images/p0_s{s}_16x16.{x}" for s in (1, 2) for x in ("png", "npy")}
    assert m["model"]["weights"].startswith("testbed:") and m["model"]["pipeline"] == "QwenImagePipeline"
    assert m["config"] == {"name": "none", "spec": "none", "optimizations": []}
    assert m["environment"]["vllm_omni"] and m["environment"]["device"]["type"]
    assert sorted(p.name for p in ref.iterdir()) == ["images", "manifest.json"]  # nothing else, no partial dir
    assert not list(ref.parent.glob(".ref.partial-*"))
    rc, res = compare(ref, ref, tmp_path / "c", "--tier", "exact")
    assert rc == 0 and res["gate"]["passed"] and "bitwise-identical" in res["gate"]["why"]
    assert all(p["tensors"]["bitwise_identical"] for p in res["pairs"]) and len(res["pairs"]) == 2
    assert {p.name for p in (tmp_path / "c").iterdir()} == {"compare.json", "compare.md", "compare.png"}
    out = capsys.readouterr().out
    assert "p0_s1_16x16" in out and "within the exact gate" in out


def test_fp32_and_bf16_sets_are_close_not_pixel_identical(ref, tmp_path):
    rc, bf = save(tmp_path, "bf16", "--tensors", "--dtype", "bfloat16")
    assert rc == 0
    rc, res = compare(ref, bf, tmp_path / "c")  # default: the close gates
    assert rc == 0 and res["tier"] == "close" and res["summary"]["pixel_identical"] < 2
    assert all(0 < p["tensors"]["rel_error"] < 0.01 for p in res["pairs"])
    dtype = next(f for f in res["facts"] if f["field"] == "dtype")
    assert (dtype["a"], dtype["b"], dtype["same"]) == ("float32", "bfloat16", False)
    assert compare(ref, bf, tmp_path / "p", "--tier", "pixel")[0] == 1
    assert compare(ref, bf, tmp_path / "e", "--tier", "exact")[0] == 1
    assert compare(ref, bf, tmp_path / "g", "--gates", "ssim=0.99,psnr=200")[0] == 1  # configurable gates
    md = (tmp_path / "g" / "compare.md").read_text()
    assert "OUTSIDE the close gate" in md and "PSNR ≥ 200.0" in md


def test_two_versions_sets_show_what_differs_and_keys_on_one_side_are_listed_never_dropped(ref, tmp_path, capsys):
    other = tmp_path / "v031"
    shutil.copytree(ref, other)

    def upgrade(m):  # B is of another release and has a second prompt's images; A lacks them
        m["environment"].update(vllm_omni="0.31.0rc1", vllm="0.31.0", diffusers="0.41.0")
        for i in list(m["images"]):
            m["images"].append({**i, "id": i["id"] + "_b", "key": {**i["key"], "prompt": "another prompt"}})

    edit_manifest(other, upgrade)
    rc, res = compare(ref, other, tmp_path / "c", "--tier", "pixel")
    assert rc == 0 and len(res["pairs"]) == 2
    facts = {f["field"]: f for f in res["facts"]}
    assert facts["vllm_omni"]["b"] == "0.31.0rc1" and not facts["vllm_omni"]["same"] and facts["torch"]["same"]
    assert [o["id"] for o in res["only_in_b"]] == ["p0_s1_16x16_b", "p0_s2_16x16_b"] and res["only_in_a"] == []
    assert "only in B: p0_s1_16x16_b" in capsys.readouterr().out
    md = (tmp_path / "c" / "compare.md").read_text()
    assert "| vllm_omni ⚠ |" in md and "0.31.0rc1" in md and "## Only in B (2, not compared)" in md


@pytest.mark.parametrize(
    "field, change",
    [
        ("model", lambda m: m["model"].update(id="tiny-other")),
        ("weights", lambda m: m["model"].update(weights="testbed:000000000000")),
        ("pipeline", lambda m: m["model"].update(pipeline="QwenImageEditPipeline")),
        ("steps", lambda m: [i["key"].update(steps=3) for i in m["images"]]),
        ("size", lambda m: [i["key"].update(width=32) for i in m["images"]]),
        ("seed", lambda m: m["images"][1]["key"].update(seed=7)),
    ],
)
def test_manifests_that_disagree_on_what_must_match_are_an_error_naming_the_field(ref, tmp_path, capsys, field, change):
    other = tmp_path / "other"
    shutil.copytree(ref, other)
    edit_manifest(other, change)
    rc, res = compare(ref, other, tmp_path / "c")
    assert rc == 2 and res is None and not (tmp_path / "c").exists()  # nothing compared, nothing written
    assert f"disagree on {field}:" in capsys.readouterr().err


def test_edit_pipelines_are_keyed_by_their_input_image(tmp_path):
    from vllm_omni_ascend_opt.testbed.pipeline import sample_image

    rc, a = save(tmp_path, "a", "--image", "sample", model="tiny-edit")
    assert rc == 0
    other_img = tmp_path / "other.png"
    sample_image(5).save(other_img)
    rc, b = save(tmp_path, "b", "--image", str(other_img), model="tiny-edit")
    assert rc == 0
    ka = json.loads((a / refset.MANIFEST).read_text())["images"][0]["key"]["input_image_sha256"]
    assert ka == refset.input_image_sha256("sample") and ka != refset.input_image_sha256(str(other_img))
    rc, res = compare(a, b, tmp_path / "c")
    assert rc == 2 and res["pairs"] == [] and len(res["only_in_a"]) == len(res["only_in_b"]) == 2
    assert "nothing compared" in res["verdict"]
    rc, res = compare(a, a, tmp_path / "same")
    assert rc == 0 and len(res["pairs"]) == 2


def _damage(root: Path, kind: str) -> Path:
    """Damage the set at ``root`` in the ``kind`` way; returns the file the error must name."""
    manifest = root / refset.MANIFEST
    if kind == "missing":
        manifest.unlink()
    elif kind == "corrupt":
        manifest.write_text('{"format": "vllm-omni-ascend-opt reference set", "version": 1, ')
    elif kind == "version":
        edit_manifest(root, lambda m: m.update(version=99))
    else:  # sha: an image replaced; size: one of another size, the hashes updated (the sizes under one key differ)
        manifest = root / "images" / ("p0_s2_16x16.png" if kind == "sha" else "p0_s1_16x16.png")
        Image.fromarray(np.zeros((16, 16, 3) if kind == "sha" else (32, 32, 3), np.uint8)).save(manifest)
        if kind == "size":
            edit_manifest(root, lambda m: None)
    return manifest


@pytest.mark.parametrize(
    "kind, msg",
    [
        ("missing", "no manifest"),
        ("corrupt", "corrupt manifest"),
        ("version", "unknown manifest version 99"),
        ("sha", "does not match the manifest"),
        ("size", "images of different sizes (16x16 vs 32x32) under one key"),
    ],
)
def test_bad_sets_are_one_clear_error_naming_the_file(ref, tmp_path, capsys, kind, msg):
    bad = shutil.copytree(ref, tmp_path / "bad")
    named = _damage(bad, kind)
    rc, _ = compare(ref, bad, tmp_path / "c")
    err = capsys.readouterr().err
    assert rc == 2 and msg in err and str(named) in err, err
    assert err.count("error:") == 1 and not (tmp_path / "c").exists()


def test_an_existing_set_is_kept_unless_fresh_and_a_failed_generation_leaves_nothing(
    ref, tmp_path, capsys, monkeypatch
):
    ref = shutil.copytree(ref, tmp_path / "ref")
    before = (ref / refset.MANIFEST).read_text()
    rc, _ = save(tmp_path, "ref")
    err = capsys.readouterr().err
    assert rc == 2 and str(ref) in err and "already holds a reference set" in err and "--fresh" in err
    assert (ref / refset.MANIFEST).read_text() == before
    rc, _ = save(tmp_path, "ref", "--fresh")
    assert rc == 0 and (ref / refset.MANIFEST).read_text() != before
    assert not json.loads((ref / refset.MANIFEST).read_text())["images"][0]["tensor"]  # replaced, no tensors now
    monkeypatch.setenv("ABLATION_FAKE", json.dumps({"error_run": {"reference": 2}}))
    rc, out = save(tmp_path, "broken")
    assert rc == 2 and "generating the set failed" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".broken.partial-*"))


@pytest.mark.multiproc
def test_default_and_none_sets_of_the_tiny_model_are_pixel_identical(tmp_path, tiny_model_dir):
    """Both sets generated at the same time (each a worker that imports vLLM-Omni: the start-up is the cost)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(save, tmp_path, n, "--config", n, fake=None) for n in ("none", "default")]
        (rc_none, none), (rc_default, default) = (j.result() for j in jobs)
    assert rc_none == rc_default == 0
    opts = json.loads((default / refset.MANIFEST).read_text())["config"]["optimizations"]
    assert opts and "vae_exact" in opts
    rc, res = compare(none, default, tmp_path / "c", "--tier", "pixel")
    assert rc == 0 and res["summary"] == {"pairs": 2, "pixel_identical": 2}


def test_ablate_reference_adds_each_configuration_against_the_set(ref, tmp_path, monkeypatch):
    from vllm_omni_ascend_opt.ablation import report, verdict
    from vllm_omni_ascend_opt.ablation.plan import OptInfo, build_plan
    from vllm_omni_ascend_opt.ablation.runner import Runner
    from vllm_omni_ascend_opt.ablation.workload import from_mapping
    from vllm_omni_ascend_opt.testbed import build_model_dir

    wl = from_mapping(dict(height=16, width=16, steps=2, seeds=[1, 2], repeats=1, warmup=0)).validate()
    plan = build_plan(wl, [OptInfo("a", "exact"), OptInfo("b", "close")])
    plan.model_path = str(build_model_dir(wl.tiny_spec()))
    monkeypatch.setenv("ABLATION_FAKE", json.dumps({"saves_ms": {"a": 5.0}, "perturb": {"b": 0.01}}))
    out = tmp_path / "abl"
    data = Runner(plan, out, progress=False, worker_cmd=FAKE, log=lambda m: None).run()
    results = report.build_results(data, verdict.analyse(plan, data.records, out), command=["test"])
    results["reference"] = setcompare.against_reference(ref, out, plan, results["environment"])
    report.write_all(results, out)
    r = results["reference"]["configs"]
    assert r["stock"]["passed"] and r["stock"]["pixel_identical"] == 2 and r["stock"]["only_here"] == 0
    assert r["full"]["pairs"] == 2 and r["full"]["pixel_identical"] < 2 and r["full"]["ssim_min"] < 1
    md = (out / "report.md").read_text()
    assert "## Against the reference set" in md and "| `stock` | ✅ | 2/2 |" in md
    # the ablation output is a set for compare too (its full configuration by default)
    rc, res = compare(ref, out, tmp_path / "c", "--tier", "pixel")
    assert rc == 1 and res["b"]["kind"] == "ablation:full"
    assert compare(ref, out, tmp_path / "s", "--config", "stock", "--tier", "pixel")[0] == 0
