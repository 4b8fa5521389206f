from lra_cond.callbacks.condition_monitor import ConditionNumberMonitor
from lra_cond.callbacks.epochs_to_target import EpochsToTarget
from lra_cond.callbacks.run_summary import RunSummary
from lra_cond.callbacks.tensorboard_summary import TensorBoardSummary

__all__ = ["ConditionNumberMonitor", "EpochsToTarget", "RunSummary", "TensorBoardSummary"]
