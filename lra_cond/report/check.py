"""What the report reads of a run folder, checked before anything is drawn or written: a damaged
entry of ``metrics.json`` or ``config.yaml`` is one error line naming the file and the key, rather
than a traceback from inside a table or a plot (and no half-written report folder)."""

from __future__ import annotations

from typing import Any

from lra_cond.errors import UserError
from lra_cond.report.collect import Run
from lra_cond.run_dir import CONFIG_FILE, METRICS_FILE, config_value

# Config values the report reads, and the kind each must be (None is always allowed).
CONFIG_KINDS = {
    "trainer.max_steps": int,
    "trainer.max_epochs": int,
    "trainer.val_check_interval": (int, float),
    "trainer.limit_val_batches": (int, float),
    "data.batch_size": int,
    "model.lr": (int, float),
    "model.warmup_steps": int,
    "cond.every_n_steps": int,
    "cond.probe_tokens": int,
}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _damaged(run: Run, file: str, key: str, value: Any, what: str) -> UserError:
    return UserError(
        f"{run.path / file}: {key} = {value!r} is not {what}; the run folder is damaged: fix the file or "
        "move the run away"
    )


def check_run(run: Run) -> None:
    """Raise ``UserError`` at the first entry the report cannot read."""
    m = run.metrics
    for i, entry in enumerate(m.get("val_history") or []):
        if not (isinstance(entry, list) and len(entry) == 2 and all(map(_number, entry))):
            raise _damaged(run, METRICS_FILE, f"val_history[{i}]", entry, "a [step, accuracy] pair")
    for i, probe in enumerate(m.get("cond_history") or []):
        where = f"cond_history[{i}]"
        if not isinstance(probe, dict) or not isinstance(probe.get("step"), int):
            raise _damaged(run, METRICS_FILE, where, probe, "a probe with its step")
        if probe.get("kappa_mean") is not None and not _number(probe["kappa_mean"]):
            raise _damaged(run, METRICS_FILE, f"{where}.kappa_mean", probe["kappa_mean"], "a number")
        layers = probe.get("layers", [])
        if not isinstance(layers, list):
            raise _damaged(run, METRICS_FILE, f"{where}.layers", layers, "a list of layers")
        for j, layer in enumerate(layers):
            at = f"{where}.layers[{j}]"
            if not isinstance(layer, dict):
                raise _damaged(run, METRICS_FILE, at, layer, "a layer's entry")
            for key in ("kappa", "kappa_x", "cut_separation"):
                if layer.get(key) is not None and not _number(layer[key]):
                    raise _damaged(run, METRICS_FILE, f"{at}.{key}", layer[key], "a number")
            if layer.get("cut_separated") not in (None, True, False):
                raise _damaged(
                    run, METRICS_FILE, f"{at}.cut_separated", layer["cut_separated"], "true or false"
                )
            weights = layer.get("weights")
            if weights is not None and not (
                isinstance(weights, dict)
                and all(isinstance(w, dict) and _number(w.get("stacked")) for w in weights.values())
            ):
                raise _damaged(run, METRICS_FILE, f"{at}.weights", weights, "the weights' condition numbers")
    counts = m.get("label_counts")
    if counts is not None and not (
        isinstance(counts, dict)
        and all(isinstance(c, list) and all(isinstance(n, int) for n in c) for c in counts.values())
    ):
        raise _damaged(run, METRICS_FILE, "label_counts", counts, "examples per class of each split")
    for key, kind in CONFIG_KINDS.items():
        value = config_value(run.config, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
            raise _damaged(run, CONFIG_FILE, key, value, "a number")
