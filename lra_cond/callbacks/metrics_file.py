"""``metrics.json``: the run summary that ``compare`` reads. Several callbacks contribute keys."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.json"


def run_dir_of(trainer: Any) -> str | None:
    """The run folder (``trainer.log_dir`` without its broadcast).

    ``Trainer.log_dir`` is a collective under DDP: called on rank zero alone (as rank-zero writers
    do) it waits forever for the other ranks. The logger's folder is the same on every rank.
    """
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    if not trainer.loggers:
        return trainer.default_root_dir
    logger = trainer.loggers[0]
    return logger.log_dir if isinstance(logger, (TensorBoardLogger, CSVLogger)) else logger.save_dir


def read_metrics(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / METRICS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def update_metrics(run_dir: str | Path, **entries: Any) -> Path:
    """Merge ``entries`` into ``run_dir/metrics.json``, written atomically (temp file + rename)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    data = {**read_metrics(run_dir), **entries}
    path = run_dir / METRICS_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path
