"""Collect run folders ``<runs_dir>/<init>/seed<k>/`` (metrics.json + config.yaml) for a report,
and find configuration differences between runs apart from init and seed."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lra_cond.callbacks.metrics_file import read_metrics
from lra_cond.errors import UserError

SEED_DIR = re.compile(r"^seed(\d+)$")
# Keys that legitimately differ between the runs of one comparison (or only record bookkeeping).
IGNORED_KEYS = (
    "seed_everything",
    "model.init",
    "model.init_args",
    "trainer.logger",
    "ckpt_path",
    "config",
    "run_root",
)


@dataclass
class Run:
    init: str
    seed: int
    path: Path
    metrics: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.metrics.get("test_acc") is not None


def load_config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return {}
    return yaml.safe_load(path.read_text()) or {}


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> ``{"a.b.c": value}`` (lists are kept as leaves)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        out.update(flatten(value, name) if isinstance(value, dict) and value else {name: value})
    return out


def _ignored(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in IGNORED_KEYS)


def config_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two configs, ignoring init, seed and bookkeeping."""
    fa, fb = flatten(a), flatten(b)
    keys = sorted(k for k in set(fa) | set(fb) if not _ignored(k))
    return [k for k in keys if fa.get(k, "<missing>") != fb.get(k, "<missing>")]


def init_order(inits: list[str]) -> list[str]:
    """``default`` first (it sets the target and the speedup baseline), then alphabetical."""
    return sorted(set(inits), key=lambda name: (name != "default", name))


def collect_runs(runs_dir: str | Path) -> list[Run]:
    """Every ``<init>/seed<k>/`` folder under ``runs_dir`` that holds a metrics.json."""
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        raise UserError(f"no such runs folder: {runs_dir} (expected e.g. runs/listops/softmax)")
    runs = []
    for init_dir in sorted(p for p in runs_dir.iterdir() if p.is_dir()):
        for seed_dir in sorted(p for p in init_dir.iterdir() if p.is_dir()):
            match = SEED_DIR.match(seed_dir.name)
            if match and (seed_dir / "metrics.json").is_file():
                runs.append(
                    Run(
                        init=init_dir.name,
                        seed=int(match.group(1)),
                        path=seed_dir,
                        metrics=read_metrics(seed_dir),
                        config=load_config(seed_dir),
                    )
                )
    if not runs:
        raise UserError(
            f"no runs under {runs_dir}: expected folders <init>/seed<k>/ with metrics.json "
            "(give the <run_root>/<task>/<attention> folder)"
        )
    order = init_order([r.init for r in runs])
    return sorted(runs, key=lambda r: (order.index(r.init), r.seed))
