"""Published LRA test accuracies (%) of the reference model, for the report's reproduction row.

- ``nystromformer``: Xiong et al. 2021, "Nyströmformer" (Table 3; the authors' LRA code, whose model
  and schedule this suite follows): softmax and Nyström (64 landmarks).
- ``xformers``: facebookresearch/xformers' rerun of that code (its LRA BENCHMARKS.md): softmax and
  Nyström with 128 landmarks; ListOps trained 10k steps there "to reduce seed dependence".
- ``lra``: Tay et al. 2021, "Long Range Arena" (Table 1), with the benchmark's own models and
  schedules, not the Nyströmformer code's: its Transformer (softmax) and Linear Transformer (linear
  attention), the only published numbers for the latter.
"""

from __future__ import annotations

from dataclasses import dataclass

TASKS = ("listops", "text", "retrieval", "image", "pathfinder")
NYSTROMFORMER = {
    "softmax": (37.10, 65.02, 79.35, 38.20, 74.16),
    "nystrom": (37.15, 65.52, 79.56, 41.58, 70.94),
}
XFORMERS = {
    "softmax": (37.5, 62.66, 79.24, 38.69, 70.37),
    "nystrom": (36.29, 63.24, 78.18, 42.86, 67.49),  # 128 landmarks
}

LRA = {
    "softmax": (36.37, 64.27, 57.46, 42.44, 71.40),
    "linear": (16.13, 65.90, 53.09, 42.34, 75.30),
}


@dataclass(frozen=True)
class Published:
    accuracy: float | None  # the Nyströmformer paper's, for this attention family
    rerun_low: float  # the range of xformers' reruns (softmax and Nyström-128) on this task
    rerun_high: float
    lra: float | None = None  # the LRA paper's, for this family (its own model and schedule)


def published(task: str, attention: str) -> Published | None:
    """What the literature reports for ``task`` (None for a task without published numbers)."""
    if task not in TASKS:
        return None
    i = TASKS.index(task)
    reruns = [scores[i] for scores in XFORMERS.values()]
    ours, lra = NYSTROMFORMER.get(attention), LRA.get(attention)
    return Published(
        None if ours is None else ours[i], min(reruns), max(reruns), None if lra is None else lra[i]
    )
