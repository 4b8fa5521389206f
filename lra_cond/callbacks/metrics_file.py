"""``metrics.json`` for the callbacks: the schema, reader and writer live in ``lra_cond.run_dir``."""

from lra_cond.run_dir import METRICS_FILE, Metrics, read_metrics, run_dir_of, update_metrics

__all__ = ["METRICS_FILE", "Metrics", "read_metrics", "run_dir_of", "update_metrics"]
