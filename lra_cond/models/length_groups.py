"""Split a batch into groups of similar length, so that each is padded only to its own longest.

A random ListOps batch of 32 pads to 1884 tokens on average while its sequences hold 1036: 45% of
the tokens that embeddings, LayerNorms, projections and MLPs see would be padding, and 65% of
softmax attention's work. Every per-token operation of the encoder treats sequences independently
(attention sees only its own sequence's keys, pooling only its real tokens), so running the batch as
a few sub-batches of neighbouring lengths gives the same per-example outputs with almost no padding.
The batch itself (which examples, in which order) is the loader's, untouched.

Each group costs some fixed work besides its tokens (the kernels' per-call set-up, the Nyström
pseudo-inverse, thread-pool barriers), so the split minimises padded tokens plus a charge per group.
"""

from __future__ import annotations

import numpy as np

# The fixed cost of one more group, in tokens: a ListOps training step with 32 x ~1000 tokens took
# 0.43-0.47 s on 2 cores with the charge anywhere in 500..4000 (2.5 to 6 groups), and grew with 16
# groups or more (see docs/benchmarks.md).
GROUP_CHARGE_TOKENS = 2048


def length_groups(lengths: list[int], charge: int | None = None) -> list[list[int]]:
    """Partition the batch positions into groups of similar ``lengths``, minimising
    sum over groups of (size x longest) + ``charge`` per group (default ``GROUP_CHARGE_TOKENS``).

    Groups are runs of the positions sorted by decreasing length (ties keep batch order), found by
    dynamic programming over where each run ends; the groups come longest first.
    """
    charge = GROUP_CHARGE_TOKENS if charge is None else charge
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    longest = np.array([max(1, lengths[i]) for i in order], dtype=np.float64)  # run i.. pads to this
    n = len(order)
    cost = np.zeros(n + 1)
    start = np.zeros(n + 1, dtype=np.int64)
    for end in range(1, n + 1):
        begins = np.arange(end)
        total = cost[:end] + (end - begins) * longest[:end] + charge
        start[end] = int(np.argmin(total))
        cost[end] = total[start[end]]
    runs, end = [], n
    while end:
        runs.append(order[start[end] : end])
        end = int(start[end])
    return runs[::-1]
