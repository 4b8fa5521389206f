"""``lra_cond.heap.heap_kept``: large blocks reused within (no page faults for a block that fits a
freed one), handed back after (the process's resident memory returns), mapped again after."""

from __future__ import annotations

import platform
import resource

import pytest
import torch

from lra_cond.heap import heap_kept

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's allocator only"
)
BLOCK = 64 << 20  # above glibc's largest mmap threshold (32 MB)


def _faults() -> int:  # this thread's minor page faults (the tests run torch on one thread)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _touched(nbytes: int) -> int:
    """Page faults of allocating ``nbytes``, writing every page, and freeing it."""
    before = _faults()
    block = torch.ones(nbytes // 8, dtype=torch.float64)
    del block
    return _faults() - before


def test_a_large_block_is_reused_within_and_handed_back_after() -> None:
    torch.set_num_threads(1)
    pages = BLOCK // resource.getpagesize()
    assert _touched(BLOCK) > pages // 2 and _touched(BLOCK) > pages // 2  # mapped afresh each time
    resident = _resident_mb()
    with heap_kept():
        first = _touched(BLOCK)
        again = _touched(BLOCK * 3 // 4)  # fits the freed block: no new pages
        held = _resident_mb()
    assert first > pages // 2 and again < pages // 100
    assert held > resident + 40  # the freed block was kept in the process ...
    assert _resident_mb() < resident + 16  # ... and handed back on the way out
    assert _touched(BLOCK) > pages // 2  # mapped again, as before


def test_the_policy_is_restored_when_the_probe_raises() -> None:
    torch.set_num_threads(1)
    resident = _resident_mb()
    with pytest.raises(RuntimeError), heap_kept():
        _touched(BLOCK)
        raise RuntimeError("a probe failed")
    assert _resident_mb() < resident + 16
    pages = BLOCK // resource.getpagesize()
    assert _touched(BLOCK) > pages // 2 and _touched(BLOCK) > pages // 2


def test_a_nested_use_keeps_the_outer_policy() -> None:
    """Leaving an inner ``heap_kept`` does not switch mapping back on under an outer one."""
    torch.set_num_threads(1)
    pages = BLOCK // resource.getpagesize()
    with heap_kept():
        with heap_kept():
            _touched(BLOCK)
        assert _touched(BLOCK * 3 // 4) < pages // 100  # still reused
    assert _touched(BLOCK) > pages // 2
