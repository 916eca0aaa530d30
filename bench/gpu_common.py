"""What bench/gpu_restore.py and bench/gpu_save.py share: their common arguments, and the GPU
they run on (or the CPU with --cpu, as a check of the script). Import JAX after this module has
set JAX_PLATFORMS, which the scripts do by importing it first."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

if "--cpu" not in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cuda")


def arguments(doc: str, default_dir: str, default_runs: int) -> argparse.ArgumentParser:
    """A parser with --runs, --dir, --out and --cpu; the script adds its own."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=default_runs)
    p.add_argument("--dir", default=default_dir)
    p.add_argument("--out", default=None, help="a JSON file for the results")
    p.add_argument("--cpu", action="store_true", help="on the CPU: a check of this script")
    return p


def first_device(args: argparse.Namespace, script: str):
    """JAX's first device, or None (after saying why) where it is a CPU and --cpu is not set."""
    import jax
    try:
        dev = jax.devices()[0]
    except (RuntimeError, AssertionError) as e:  # no CUDA backend at all
        print(f"{script}: JAX has no GPU ({type(e).__name__}: {e}); --cpu runs it on the CPU",
              file=sys.stderr)
        return None
    if dev.platform == "cpu" and not args.cpu:
        print(f"{script}: JAX sees no GPU (--cpu runs it on the CPU)", file=sys.stderr)
        return None
    return dev


def finish(args: argparse.Namespace, results: dict) -> int:
    """Writes `results` to --out (if given), removes --dir; the script's exit status (0)."""
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0
