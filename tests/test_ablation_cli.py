"""``vllm-omni-ascend-opt plan`` and ``ablate``'s argument handling (no worker is started here)."""

from __future__ import annotations

import json

import pytest

from vllm_omni_ascend_opt import registry
from vllm_omni_ascend_opt.ablation.cli import TINY_DEFAULT, resolve_workload
from vllm_omni_ascend_opt.ablation.workload import Workload, load_workload
from vllm_omni_ascend_opt.cli import build_parser, main


def test_plan_lists_configurations_runs_and_estimate(capsys, tmp_path):
    assert main(["plan", "--workload", "tiny-cpu", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "configuration" in out and "stock" in out and "full_ctrl" in out and "estimated" in out
    for opt in registry.all_optimizations():  # every optimization is either in the run or listed as skipped
        assert opt.name in out
    assert "device-time model" not in out  # the device-time model is of a real checkpoint only
    assert not (tmp_path / "o").exists()  # a dry run writes nothing


def test_plan_json_and_modes(capsys, tmp_path):
    names = [o.name for o in registry.all_optimizations() if not o.reasons_inactive()]
    if not names:
        pytest.skip("no optimization can be active on this machine")
    args = ["plan", "--json", "--mode", "single", "--only", names[0], "--repeats", "3", "--seeds", "1", "2"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [c["id"] for c in doc["plan"]["configs"]] == ["stock", "full", "full_ctrl"]
    assert doc["plan"]["configs"][1]["spec"] == f"none,+{names[0]}"
    assert doc["estimate"]["measured"] == 3 * 3 * 2
    assert doc["stored_measurements"] == 0


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--only", "nonsense"], "unknown optimization 'nonsense'"),
        (["--height", "30"], "multiple of 16"),
        (["--quality-gates", "ssim=high"], "not a number"),
        (["--quality-gates", "lpips=0.1"], "use ssim="),
        (["--workload", "nope"], "no workload named 'nope'"),
        (["--model", "/nonexistent/qwen"], "no such directory"),
        (["--seeds", "1", "1"], "distinct"),
        (["--prompts-file", "/nonexistent.txt"], "--prompts-file"),
        (["--import", "no_such_module_xyz"], "--import no_such_module_xyz"),
    ],
)
@pytest.mark.parametrize("cmd", ["plan", "ablate"])
def test_bad_input_is_a_clear_message_and_exit_2(capsys, tmp_path, cmd, argv, msg):
    out = tmp_path / "o"
    assert main([cmd, *argv, "--out", str(out)]) == 2
    assert msg in capsys.readouterr().err
    assert not out.exists()


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["ablate", "--mode", "bogus"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_ablate_with_nothing_to_measure_starts_nothing(capsys, tmp_path):
    inactive = [o.name for o in registry.all_optimizations() if o.reasons_inactive()]
    if not inactive:
        pytest.skip("every optimization can be active here")
    out = tmp_path / "o"
    assert main(["ablate", "--only", inactive[0], "--out", str(out)]) == 2
    cap = capsys.readouterr()
    assert "nothing to measure" in cap.err and inactive[0] in cap.out
    assert not out.exists()


def test_prompts_file_and_overrides_reach_the_workload(tmp_path):
    pf = tmp_path / "prompts.txt"
    pf.write_text("# a comment\na cat\n\na dog\n")
    argv = "ablate --workload tiny-cpu --steps 3 --quality-gates ssim=0.95,psnr=30 --no-enforce-eager".split()
    wl = resolve_workload(build_parser().parse_args([*argv, "--prompts-file", str(pf)]))
    assert wl.prompts == ["a cat", "a dog"] and wl.steps == 3 and (wl.ssim_gate, wl.psnr_gate) == (0.95, 30.0)
    assert wl.enforce_eager is False and wl.name == "tiny-cpu (modified)" and wl.seeds  # the rest from the file


def test_the_plain_tiny_flow_runs_the_tiny_cpu_workload():
    """``ablate --model tiny`` (no workload) measures what ``make demo`` measures: the deeper tiny model, its steps,
    CFG and rounds; command-line values still override, and another model keeps the plain defaults."""
    ref = load_workload(TINY_DEFAULT)
    for argv in (["ablate"], ["ablate", "--model", "tiny"]):
        wl = resolve_workload(build_parser().parse_args(argv))
        for key in ("model", "steps", "cfg_scale", "repeats", "process_sets"):
            assert getattr(wl, key) == getattr(ref, key), key
        assert wl.model == "tiny-deep"
    wl = resolve_workload(build_parser().parse_args(["ablate", "--model", "tiny", "--steps", "3"]))
    assert wl.steps == 3 and wl.model == "tiny-deep" and wl.name == f"{TINY_DEFAULT} (modified)"
    wl = resolve_workload(build_parser().parse_args(["ablate", "--model", "tiny-dmd2"]))
    assert wl.model == "tiny-dmd2" and wl.steps == Workload().steps
