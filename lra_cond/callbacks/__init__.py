from lra_cond.callbacks.metrics_file import read_metrics, update_metrics
from lra_cond.callbacks.run_summary import RunSummary

__all__ = ["RunSummary", "read_metrics", "update_metrics"]
