"""The plugin inside ``vllm serve <tiny model> --omni`` (vLLM-Omni's OpenAI-compatible server), over real HTTP.

Four servers start at once, each in its own process group: ``default`` (mp executor, a 0.02 MiB memo budget so the
soak evicts), ``stock`` (``none``, in-process: the references, so the default server's images cross from its mp
worker), ``bogus`` (a bad flag, in-process) and ``strict`` (the same in strict mode: must fail to start). Each writes
the plugin's JSON status file after every request. An engine whose ``VLLM_PLUGINS`` excludes ours is
test_omni_offline's (the same vLLM-Omni engine and plugin loader under the server).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from vllm_omni_ascend_opt.testbed.serve import OmniServer, image_request, stop_all

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

NPU_FREE_DEFAULT = ["shared_modulation", "rope", "vae_exact", "joint_attention"]
MEMO_BUDGET_MB = 0.02
STATUS_LINE = "vllm-omni-ascend-opt 0.1.0 (VLLM_OMNI_ASCEND_OPT={flag})"

#: Mixed requests for the concurrency test: sizes, step counts, seeds, true CFG on/off.
MIXED = [
    dict(width=32, height=32, steps=2, seed=42),
    dict(width=48, height=32, steps=3, seed=1),
    dict(width=32, height=48, steps=2, seed=2, cfg_scale=4.0, negative_prompt="blurry"),
    dict(width=64, height=64, steps=2, seed=3),
    dict(width=32, height=32, steps=4, seed=42, cfg_scale=3.0, negative_prompt=" "),
    dict(width=16, height=32, steps=3, seed=5),
    dict(width=48, height=48, steps=2, seed=6, cfg_scale=2.0, negative_prompt="dark"),
    dict(width=32, height=32, steps=2, seed=43),
]
PROMPTS = ["a red cat", "a blue house by the sea"]


def _body(i: int) -> dict:
    return image_request(PROMPTS[i % 2], **MIXED[i])


class _Servers:
    def __init__(self, model: Path, root: Path) -> None:
        def make(name: str, flag: str, mp: bool, **extra: str) -> OmniServer:
            env = {
                "VLLM_OMNI_ASCEND_OPT": flag,
                "VLLM_OMNI_ASCEND_OPT_STATUS_FILE": str(root / f"{name}.status.json"),
                **extra,
            }
            return OmniServer(str(model), root / f"{name}.log", env=env, mp=mp)

        self.root = root
        self.default = make("default", "default", True, VLLM_OMNI_ASCEND_OPT_MODULATION_CACHE_MB=str(MEMO_BUDGET_MB))
        self.stock = make("stock", "none", False)
        self.bogus = make("bogus", "bogus", False)
        self.strict = make("strict", "bogus", False, VLLM_OMNI_ASCEND_OPT_STRICT="1")
        self.all = [self.default, self.stock, self.bogus, self.strict]
        self.strict_rc: int | None = None

    def status(self, name: str) -> dict:
        return json.loads((self.root / f"{name}.status.json").read_text())

    def assert_stock(self, srv: OmniServer, i: int):
        """``srv``'s answer to request ``i`` is stock's image; returns it."""
        r, ref = srv.generate(_body(i)), self.stock.generate(_body(i))
        assert r.status == 200 and ref.status == 200, (r.body, ref.body)
        assert r.image().std() > 0 and np.array_equal(r.image(), ref.image()), f"request {i} differs from stock"
        return r


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    s = _Servers(tiny_model_dir, tmp_path_factory.mktemp("omni_serve"))
    try:
        for srv in s.all:
            srv.start()
        s.strict_rc = s.strict.wait_exit(timeout=300)
        for srv in (s.default, s.stock, s.bogus):
            srv.wait_ready(timeout=420)
        yield s
    finally:
        stop_all(s.all)


def test_default_server_serves_stock_identical_png_from_its_mp_worker(servers):
    d = servers.default
    assert d.healthy() and servers.stock.healthy()
    r = servers.assert_stock(d, 0)
    assert r.png is not None and r.png[:8] == b"\x89PNG\r\n\x1a\n" and r.image().shape == (32, 32, 3)
    status = servers.status("default")
    assert status["pid"] != d.proc.pid, "the model must live in the mp worker, not the API server process"
    # memo_aware_offload is installed (vLLM-Omni imports its offloader everywhere) and does not act without offload
    assert status["installed"] == [*NPU_FREE_DEFAULT, "memo_aware_offload"]
    assert status["acting_on_pipeline"] == NPU_FREE_DEFAULT
    assert "layerwise offload is not enabled" in status["off"]["memo_aware_offload"]
    assert servers.status("stock")["installed"] == []
    # the status line: one per process that loads the plugin
    lines = [ln for ln in d.log_text().splitlines() if STATUS_LINE.format(flag="default") in ln]
    worker = [ln for ln in lines if "DiffusionWorker" in ln]
    api = [ln for ln in lines if "APIServer" in ln]
    assert len(worker) == 1 and len(api) == 1, lines
    assert (
        " INFO " in worker[0]
        and "installed shared_modulation, rope, vae_exact, joint_attention, memo_aware_offload; off: fused_attention"
        in worker[0]
    )
    assert "vae_fast (not selected by VLLM_OMNI_ASCEND_OPT)" in worker[0]
    stock = [ln for ln in servers.stock.log_text().splitlines() if STATUS_LINE.format(flag="none") in ln]
    assert stock and all("installed nothing" in ln for ln in stock)
    # a bad request gets a 4xx and the next request succeeds
    bad = d.generate({**_body(0), "size": "0x0"})
    assert 400 <= bad.status < 500, bad.body
    servers.assert_stock(d, 3)


def test_bogus_flag_logs_once_and_serves_stock_but_fails_start_under_strict(servers):
    b = servers.bogus
    errors = [ln for ln in b.log_text().splitlines() if "unknown optimization 'bogus'" in ln]
    assert len(errors) == 1, errors
    assert " ERROR " in errors[0] and "Valid names: shared_modulation, rope" in errors[0]
    status = servers.status("bogus")
    assert status["installed"] == [] and status["selected"] == [] and "bogus" in status["config_error"]
    servers.assert_stock(b, 1)
    assert servers.strict_rc not in (None, 0), "strict mode with a bad flag must stop the server"
    log = servers.strict.log_text()
    assert "PluginConfigError" in log and "unknown optimization 'bogus'" in log


def test_concurrent_mixed_requests_match_stock_and_a_soak_keeps_caches_within_budget(servers):
    d, st = servers.default, servers.stock
    with ThreadPoolExecutor(max_workers=len(MIXED)) as pool:
        got = list(pool.map(lambda i: d.generate(_body(i), timeout=300), range(len(MIXED))))
    for i, r in enumerate(got):
        assert r.status == 200, (i, r.body)
        ref = st.generate(_body(i))
        assert ref.status == 200, ref.body
        a, b = r.image(), ref.image()
        assert a.shape == (MIXED[i]["height"], MIXED[i]["width"], 3)
        assert np.array_equal(a, b), f"request {i} {MIXED[i]} differs from stock"
    before = servers.status("default")["requests"]
    sizes = [(32, 32), (48, 48), (64, 32), (32, 64), (64, 64), (16, 16)]
    n, deadline = 24, time.monotonic() + 300
    for i in range(n):
        assert time.monotonic() < deadline, f"soak too slow: {i} of {n} requests in 300 s"
        w, h = sizes[i % len(sizes)]
        r = d.generate(image_request("soak", width=w, height=h, steps=2 + i % 4, seed=1000 + i))
        assert r.status == 200, (i, r.body)
    status = servers.status("default")
    assert status["requests"] >= before + n
    memo, rope = status["memory"]["shared_modulation"], status["memory"]["rope"]
    assert memo["budget_bytes"] == int(MEMO_BUDGET_MB * 1024**2)
    assert 0 < memo["bytes"] <= memo["budget_bytes"], memo
    assert memo["evictions"] > 0, "the soak must have filled the memo past its budget"
    assert 0 < rope["tables"] <= rope["table_cap"], rope
    assert d.healthy()
    servers.assert_stock(d, 4)  # after evictions, a cached request still gives stock's image


def test_servers_stop_by_pid_leaving_no_process(servers):
    stop_all(servers.all)
    for srv in servers.all:
        assert srv.proc.poll() is not None
        assert not srv.group_alive(), f"processes of {srv.log_path.name}'s group survived stop()"
