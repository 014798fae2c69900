"""The trace table the device-time model reads (``benchmarks/bench_devtime.py --write-table`` writes it): per workload
and configuration, one warm transformer call and one VAE decode, each op ``[name, kind, site, launches, flops, bytes]``.
"""

from __future__ import annotations

import functools
import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_omni_ascend_opt.devtime import trace as T
from vllm_omni_ascend_opt.devtime.trace import BLOCKS, TEXT_TOKENS, OpTable

TABLE_FILE = Path(__file__).with_name("devtime_table.json.gz")
VERSION = 1
#: (height, width) in pixels: the issue's resolutions, the reference's 1280x704 among them.
RESOLUTIONS: tuple[tuple[int, int], ...] = ((512, 512), (1024, 1024), (1328, 1328), (928, 1664), (704, 1280))
BATCHES = (1, 2)
REFERENCE_RES = (704, 1280)
#: The default optimizations that act only through torch_npu kernels (the default less these: ``portable``).
NPU_ONLY = ("fused_attention", "nz_weights", "qk_norm")


def workload_key(height: int, width: int, batch: int) -> str:
    return f"{width}x{height}/B{batch}"


def transformer_names() -> list[str]:
    """The registered optimizations that patch the transformer module (in registry order)."""
    from vllm_omni_ascend_opt import registry
    from vllm_omni_ascend_opt.blocks.upstream import targets

    return registry.patching(targets.TRANSFORMER)


def vae_names() -> list[str]:
    """The registered optimizations that act in the VAE decode (in registry order)."""
    from vllm_omni_ascend_opt import registry

    return registry.in_region("vae")


def _only(names: Any) -> str:
    """The spec that selects ``names`` and nothing else."""
    return ",".join(["none", *(f"+{n}" for n in names)])


def configurations() -> dict[str, str]:
    """Name -> spec: the op tables' configurations, ``default-<name>`` (leave-one-out), the reference's ``pixel`` and
    ``pixel+vae`` stacks, and ``portable`` (the default less :data:`NPU_ONLY`) less each of its optimizations."""
    from vllm_omni_ascend_opt import registry
    from vllm_omni_ascend_opt.testbed import blockops

    opts = registry.all_optimizations()
    out = blockops.configurations()
    pixel = [o.name for o in opts if o.default_enabled and o.equivalence in ("exact", "pixel")]
    out["pixel"] = _only(n for n in pixel if n in transformer_names())
    out["pixel+vae"] = out["pixel"] + ",+vae_exact"
    out.update({f"default-{o.name}": f"default,-{o.name}" for o in opts if o.default_enabled})
    portable = [o.name for o in opts if o.default_enabled and o.name not in NPU_ONLY]
    out["portable"] = "default," + ",".join(f"-{n}" for n in NPU_ONLY)
    out.update({f"portable-{n}": f"{out['portable']},-{n}" for n in portable})
    return out


def ordered(names: Any) -> list[str]:
    """``names`` in :func:`configurations` order (the table's JSON keys are sorted)."""
    order = list(configurations())
    return sorted(names, key=lambda n: order.index(n) if n in order else len(order))


def _parts(names: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``names``' transformer and VAE optimizations, each sorted."""
    return tuple(sorted(set(names) & set(transformer_names()))), tuple(sorted(set(names) & set(vae_names())))


def find_config(table: dict[str, Any], opts: list[str] | tuple[str, ...]) -> str | None:
    """The table's configuration that selects the same optimizations as ``opts`` for the transformer and the VAE."""
    first = next(iter(table["workloads"].values()))
    return next((name for name, entry in first.items() if _parts(entry["opts"]) == _parts(opts)), None)


def build(rt: Any, *, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Trace every (workload, configuration), sharing equal traces; the torch_npu fake must be installed."""
    from vllm_omni_ascend_opt import flags as flags_mod

    configs = configurations()
    tr, vae = T.build_transformer(rt), T.build_vae()
    out: dict[str, Any] = {
        "version": VERSION,
        "blocks": BLOCKS,
        "text_tokens": TEXT_TOKENS,
        "configs": configs,
        "workloads": {},
    }
    for h, w in RESOLUTIONS:
        for b in BATCHES:
            kw = T.transformer_inputs(tr, h, w, b)
            traced: dict[tuple[str, tuple[str, ...]], list[list[Any]]] = {}
            entry: dict[str, Any] = {}
            for name, spec in configs.items():
                opts = flags_mod.parse_spec(spec)
                tr_opts, vae_opts = _parts(opts)
                tkey, vkey = ("transformer", tr_opts), ("vae", vae_opts)
                if tkey not in traced:
                    traced[tkey] = T.trace_transformer(rt, tr, _only(tkey[1]), kw).per_call(BLOCKS).to_list()
                if vkey not in traced:
                    traced[vkey] = T.trace_vae(rt, vae, _only(vkey[1]), h, w, b).per_call().to_list()
                entry[name] = {"opts": list(opts), "transformer": traced[tkey], "vae": traced[vkey]}
                if progress:
                    progress(f"{workload_key(h, w, b)} {name}")
            out["workloads"][workload_key(h, w, b)] = entry
    return out


def write(table: dict[str, Any], path: Path = TABLE_FILE) -> None:
    """Gzipped JSON, FLOPs and bytes as integers (deterministic: no timestamp in the gzip header)."""
    for entry in table["workloads"].values():
        for cfg in entry.values():
            for part in ("transformer", "vae"):
                cfg[part] = [[n, k, s, c, int(f), int(b)] for n, k, s, c, f, b in cfg[part]]
    raw = json.dumps(table, separators=(",", ":"), sort_keys=True).encode()
    path.write_bytes(gzip.compress(raw, compresslevel=9, mtime=0))


@functools.cache
def load(path: Path = TABLE_FILE) -> dict[str, Any]:
    return json.loads(gzip.decompress(path.read_bytes()))


def call_ops(table: dict[str, Any], workload: str, config: str, part: str = "transformer") -> OpTable:
    """The :class:`~.trace.OpTable` of one transformer call (``part="transformer"``) or one VAE decode."""
    return OpTable.from_list(table["workloads"][workload][config][part])
