"""The threading contract (README, "On a real NPU"): one transformer forward at a time per process. The per-forward
scope is owned by the thread that opened it: a forward on another thread meanwhile is unscoped and logs one warning."""

from __future__ import annotations

import logging
import threading

import torch
import torch.nn as nn

from vllm_omni_ascend_opt.blocks.upstream import forward_scope


class _Probe(nn.Module):
    """Each forward asks one per-forward decision (its own thread's name) and returns it."""

    def __init__(self, inside: threading.Event | None = None, go: threading.Event | None = None) -> None:
        super().__init__()
        self.inside, self.go = inside, go

    def forward(self, x: torch.Tensor) -> str:
        first = forward_scope.decide("who", lambda: threading.current_thread().name)
        if self.inside is not None:
            self.inside.set()  # the other thread may start its forward now
            assert self.go is not None and self.go.wait(10)
        return forward_scope.decide("who", lambda: "second ask") + "/" + first


def test_one_forward_at_a_time_per_process_and_a_second_thread_is_unscoped(caplog):
    inside, go = threading.Event(), threading.Event()
    a, b = _Probe(inside, go), _Probe()
    forward_scope.watch(a, "test")
    forward_scope.watch(b, "test")
    out: dict[str, str] = {}
    try:
        t = threading.Thread(target=lambda: out.update(a=a(torch.ones(1))), name="worker-a")
        t.start()
        assert inside.wait(10)  # worker-a's forward is open
        with caplog.at_level(logging.WARNING, logger="vllm_omni_ascend_opt"):
            out["b"] = b(torch.ones(1))  # main thread, meanwhile: outside the contract
            out["b2"] = b(torch.ones(1))
        go.set()
        t.join(10)
    finally:
        forward_scope.unwatch(a, "test")
        forward_scope.unwatch(b, "test")
        forward_scope.reset()
    assert out["a"] == "worker-a/worker-a"  # scoped: the second ask reuses the first decision
    assert out["b"] == "second ask/MainThread"  # unscoped: never worker-a's table
    assert caplog.text.count("two transformer forwards run at once") == 1
    forward_scope.watch(b, "test")
    try:
        assert b(torch.ones(1)) == "MainThread/MainThread"  # one forward at a time again: scoped
    finally:
        forward_scope.unwatch(b, "test")
