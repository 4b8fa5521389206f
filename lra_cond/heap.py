"""The process's heap: no oneDNN kernel cache (``no_kernel_cache``), and large blocks kept while a
condition-number probe runs (``heap_kept``, glibc only).

glibc serves an allocation above its mmap threshold (at most 32 MB: a probe's Gram matrices,
factors and couplings are larger) that its free memory cannot hold with a fresh mapping, and
unmaps it when freed, so the next one page-faults its way in again, onto freshly zeroed pages
(docs/benchmarks.md, "Speed paths in the probe"). While the probe runs, mapping is off
(``M_MMAP_MAX`` 0): freed blocks stay in the heap and are reused. Afterwards it is on again, and
``malloc_trim`` hands the probe's free memory back to the system.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # glibc's mallopt parameters
MMAP_THRESHOLD = 32 << 20  # glibc's dynamic thresholds' steady state (the largest mmap threshold)


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt, libc.malloc_trim  # noqa: B018 (both must exist)
    except (OSError, AttributeError):
        return None
    return libc


_depth = 0  # nested uses: only the outermost switches the policy


@contextmanager
def heap_kept() -> Iterator[None]:
    """Within: every allocation from the heap, freed memory kept for reuse. After: glibc's policy
    as it settles by itself once a large block has been freed (its dynamic thresholds, which any
    mallopt of these switches off): blocks above 32 MB mapped, free heap above 64 MB returned."""
    global _depth
    libc = _glibc()
    switch = libc is not None and not _depth
    if switch:
        libc.mallopt(M_MMAP_MAX, 0)
        libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if switch:
            libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            libc.mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD)
            libc.mallopt(M_MMAP_MAX, 65536)
            libc.malloc_trim(0)


def no_kernel_cache() -> None:
    """Keep no compiled oneDNN kernel per tensor shape (unless ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` is
    set already). On CPU, torch runs some operations (GELU among them) through oneDNN, which compiles
    a kernel for each new shape and caches up to 1024 of them. Batches run as length groups bring new
    shapes at every step, so the cache almost never hits, and each entry it adds lands between the
    step's freed activations: glibc's heap then fragments and grows for thousands of steps (a
    ListOps fit reached 6 GB resident where a step needs 1.5 GB; docs/benchmarks.md, "Resident
    memory of a long fit"). Read by oneDNN at its first kernel, so call this before any. With it, a
    fit's heap no longer grows, and nothing needs handing back between validations."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "0")
