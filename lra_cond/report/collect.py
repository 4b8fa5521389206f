"""Collect run folders ``<runs_dir>/<init>/seed<k>/`` (metrics.json + config.yaml) for a report,
and find configuration differences between runs apart from init and seed. The folders are read
through ``lra_cond.run_dir``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lra_cond import run_dir
from lra_cond.errors import UserError
from lra_cond.run_dir import read_metrics

# The init every other is compared with: it sets the target accuracy and the speedup baseline.
BASELINE = "default"
# Keys that legitimately differ between the runs of one comparison (or only record bookkeeping).
IGNORED_KEYS = (
    "seed_everything",
    "model.init",
    "model.init_args",
    "trainer.logger",
    "ckpt_path",
    "config",
    "run_root",
    "run_name",
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
        return run_dir.is_finished(self.metrics)


def load_config(folder: Path) -> dict[str, Any]:
    return run_dir.read_config(folder)


def config_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two configs, ignoring init, seed and bookkeeping. A
    key one config lacks and the other holds as null is an option added to the suite between the
    two runs, left at its default (the suite's new options default to null): not a difference."""
    only_one = set(run_dir.flatten(a)) ^ set(run_dir.flatten(b))
    return run_dir.config_differences(a, b, IGNORED_KEYS, defaults={k: None for k in only_one})


def init_order(inits: list[str]) -> list[str]:
    """The ``BASELINE`` init first (it sets the target and the speedup baseline), then alphabetical."""
    return sorted(set(inits), key=lambda name: (name != BASELINE, name))


def collect_runs(runs_dir: str | Path) -> list[Run]:
    """Every ``<init>/seed<k>/`` folder under ``runs_dir`` that holds a metrics.json."""
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        raise UserError(f"no such runs folder: {runs_dir} (expected e.g. runs/listops/softmax)")
    runs = []
    for init_dir in sorted(p for p in runs_dir.iterdir() if p.is_dir()):
        for seed_dir in sorted(p for p in init_dir.iterdir() if p.is_dir()):
            seed = run_dir.seed_of(seed_dir)
            if seed is not None and (seed_dir / run_dir.METRICS_FILE).is_file():
                runs.append(
                    Run(
                        init=init_dir.name,
                        seed=seed,
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
