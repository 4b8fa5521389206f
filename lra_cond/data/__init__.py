from lra_cond.data.datamodule import LraDataModule
from lra_cond.data.tasks import TASKS, TaskSpec

__all__ = ["LraDataModule", "TASKS", "TaskSpec"]
