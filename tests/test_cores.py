"""A fit on CPU says so when other work already holds the cores its threads need."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import run_cli_in_process

from lra_cond import cores
from lra_cond.cores import busy_cores, oversubscribed_note


@pytest.mark.parametrize(
    "threads, busy, n_cores, advice",
    [
        (1, 2.0, 2, None),  # one thread waits on no other
        (2, None, 2, None),  # nothing measured
        (2, 0.3, 2, None),  # both cores free
        (2, 0.7, 2, "OMP_NUM_THREADS=1"),  # a core mostly held by another process
        (2, 2.0, 2, "OMP_NUM_THREADS=1"),
        (16, 8.2, 16, "OMP_NUM_THREADS=8"),
        (8, 8.0, 16, None),  # eight cores left for eight threads
    ],
)
def test_a_note_only_when_fewer_cores_are_free_than_threads(threads, busy, n_cores, advice):
    note = oversubscribed_note(threads, busy, n_cores)
    if advice is None:
        assert note is None
    else:
        assert note is not None and advice in note and f"{busy:.1f} of this machine's {n_cores} cores" in note


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="reads /proc/stat")
def test_busy_cores_counts_another_process_s_work():
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # the loop is running
        busy = busy_cores(0.5)
    finally:
        spin.kill()
        spin.wait()
    assert busy is not None and 0.7 <= busy <= (os.cpu_count() or 1) + 0.01


def test_busy_cores_is_none_where_proc_stat_cannot_be_read(monkeypatch):
    def unreadable() -> tuple[int, int]:
        raise FileNotFoundError("/proc/stat")

    monkeypatch.setattr(cores, "_cpu_times", unreadable)
    assert busy_cores(0.0) is None


@pytest.mark.parametrize("busy, noted", [(2.0, True), (0.0, False)])
def test_fit_prints_the_note_before_it_looks_at_the_data(busy, noted, tmp_path, monkeypatch, capfd):
    monkeypatch.setattr("lra_cond.training.lightning_cli.busy_cores", lambda: busy)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    torch.set_num_threads(2)  # the autouse one_thread fixture restores it
    # text's full split is not prepared here: fit stops at the data, after the note
    args = ["fit", "--task", "text", "--data.data_dir", "no/such/dir"]
    proc = run_cli_in_process(args, tmp_path, monkeypatch, capfd)
    assert proc.returncode == 2 and "no prepared data at no/such/dir/text/full/prepared" in proc.stderr
    note = "note: 2.0 of this machine's 2 cores are busy with other work: torch's 2 threads will wait"
    assert (note in " ".join(proc.stderr.split())) is noted, proc.stderr
