"""Whether torch's threads will find their cores free, told before a fit trains.

torch's intra-op threads meet at a barrier after every parallel operation, so one thread that
another process keeps off its core stalls the others. On a 2-core machine a fit at 2 threads beside
one busy process ran 2x slower than the same fit at 1 thread (docs/benchmarks.md, "Threads beside
other work"). The fit does not change its own thread count (that would change its numbers); it says
so, and the user chooses.
"""

from __future__ import annotations

import os
import time


def _cpu_times() -> tuple[int, int]:
    """(total, idle) jiffies of all CPUs since boot, from the first line of /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]  # user .. steal (guest is inside user)
    return sum(fields), fields[3] + fields[4]  # idle + iowait


def busy_cores(sample_s: float = 0.1) -> float | None:
    """How many cores were busy over the next ``sample_s`` seconds, while this process sleeps (so
    the count is other processes' work); None where /proc/stat cannot be read."""
    try:
        total0, idle0 = _cpu_times()
        time.sleep(sample_s)
        total1, idle1 = _cpu_times()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    return (1.0 - (idle1 - idle0) / (total1 - total0)) * (os.cpu_count() or 1)


def oversubscribed_note(threads: int, busy: float | None, cores: int) -> str | None:
    """A note when fewer than ``threads`` cores are free (a core counts as busy from half a core of
    other work), else None."""
    if threads <= 1 or busy is None:
        return None
    free = round(cores - busy)
    if free >= threads:
        return None
    return (
        f"{busy:.1f} of this machine's {cores} cores are busy with other work: torch's {threads} "
        f"threads will wait on each other; OMP_NUM_THREADS={max(1, free)} trains faster while that "
        "lasts (docs/benchmarks.md)"
    )
