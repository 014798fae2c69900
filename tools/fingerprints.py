#!/usr/bin/env python3
"""Print the source fingerprints of every upstream function the optimizations declare, for the installed vLLM-Omni.

    python tools/fingerprints.py          # one line per (optimization, function): fingerprint, known releases
    python tools/fingerprints.py --json   # the same as JSON

What to do with a new vLLM-Omni release (issue 22): install it, run this, and for each function marked ``NEW``
redo the exactness argument of the optimizations that declare it (read the diff), adapt them where needed, then add
the fingerprint with the release to their ``upstream`` tables (``blocks/upstream/targets.py`` for shared declarations). Until
then those optimizations stay off there with a reason naming the function. Nothing of vLLM-Omni is imported.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_omni_ascend_opt import registry
from vllm_omni_ascend_opt.blocks.upstream import fingerprints


def rows() -> list[dict]:
    out = []
    for opt in registry.all_optimizations():
        for f in fingerprints.check(opt.upstream, platform="cpu"):
            out.append(
                {"optimization": opt.name, **f.as_dict(), "known": {k: list(v) for k, v in f.decl.known.items()}}
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        omni = metadata.version("vllm-omni")
    except metadata.PackageNotFoundError:
        omni = None
    data = rows()
    if args.json:
        print(json.dumps({"vllm_omni": omni, "functions": data}, indent=1))
        return 0
    print(f"vllm-omni {omni or 'not installed'}")
    for r in data:
        state = ("known: " + ", ".join(r["matches"])) if r["matches"] else "NEW"
        print(f"{r['optimization']:<18} {r['function']:<95} {r['fingerprint']:<16}  {state}")
    new = sum(not r["matches"] for r in data)
    print(f"{len(data)} declarations, {new} with a fingerprint no table knows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
