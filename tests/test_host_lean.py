"""Host-lean hot path (issue 21): the host-sync counter of the test bed, per-forward decisions and their invalidation,
the memo's weight keys under layerwise offload, and the direct calls of known layers."""

from __future__ import annotations

import torch

from vllm_omni_ascend_opt.testbed.opcount import SyncCounter


# ----------------------------------------------------------------------------------------------------------------
# the host-sync counter
# ----------------------------------------------------------------------------------------------------------------
def test_sync_counter_counts_each_host_read_once_and_says_where():
    x = torch.randn(4)
    with SyncCounter() as s:
        x.sum().item()  # item -> _local_scalar_dense, counted once
        if x.sum() > 0:  # tensor truthiness
            pass
        x.tolist()
        host = x.cpu()  # the copy to the host
        host.reshape(-1).numpy()  # a read of the host copy: not a second sync
        torch.equal(x, x)  # aten::equal returns a host bool
        float(x[0])  # __float__ -> _local_scalar_dense
    assert s.total == 6, dict(s.sites)
    assert all("test_host_lean.py" in site for site in s.sites)
    y = torch.randn(3)
    with SyncCounter() as s2:
        y + 1
        y.numpy()  # not a read of a .cpu() copy: counted
    assert s2.total == 1
    assert torch.Tensor.item is torch._C.TensorBase.item  # restored on exit
