"""Pathfinder generation speed (images/s, PNGs included): ``python -m lra_cond.data_prep.pathfinder_bench``.

Prints one JSON line per worker count: wall seconds, CPU seconds (all processes), images/s, images per
CPU second, and the wall-clock estimate for a 200k release. A benchmark, not a test: numbers depend on
the machine and its load (on a shared machine, images per CPU second is the steadier figure).
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

from lra_cond.data_prep.pathfinder_gen import pathfinder_config
from lra_cond.data_prep.pathfinder_release import write_release


def _cpu_seconds() -> float:
    """User + system CPU of this process and its finished children (the worker processes)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size", type=int, default=32, choices=(32, 128))
    p.add_argument("--contour", type=int, default=14, choices=(6, 9, 14))
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--chunk", type=int, default=250)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = p.parse_args()
    cfg = pathfinder_config(args.size, args.contour)
    for workers in args.workers:
        with tempfile.TemporaryDirectory() as tmp:
            wall, cpu = time.perf_counter(), _cpu_seconds()
            write_release(Path(tmp), cfg, args.images, seed=0, workers=workers, chunk=args.chunk, grid=False)
            wall, cpu = time.perf_counter() - wall, _cpu_seconds() - cpu
        rate = args.images / wall
        row = {
            "size": args.size,
            "contour": args.contour,
            "images": args.images,
            "workers": workers,
            "wall_s": round(wall, 2),
            "cpu_s": round(cpu, 2),
            "images_per_s": round(rate, 1),
            "images_per_cpu_s": round(args.images / cpu, 1),
            "est_200k_min": round(200_000 / rate / 60, 1),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
