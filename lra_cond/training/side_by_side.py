"""Run several ``fit`` subprocesses side by side (``compare --jobs N``), the cores split between them.

Each fit gets ``threads`` intra-op threads (``OMP_NUM_THREADS``), writes its output to its own log
file, and runs in its own session: the terminal's Ctrl-C (or a scheduler's SIGTERM) reaches this
process alone, which passes one SIGINT to every running fit, so each stops at the end of its step
with ``last.ckpt`` saved, and no further fit is started. Progress is read from each run folder's
``metrics.json`` (written at every validation): one line per running fit, redrawn in place on a
terminal, printed as it changes otherwise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from lra_cond.run_dir import read_metrics

POLL_SECONDS = 2.0


@dataclass
class Fit:
    """One fit to run: its label, command, run folder, log file and total steps."""

    label: str
    cmd: list[str]
    run_dir: Path
    log: Path
    max_steps: int
    process: subprocess.Popen | None = field(default=None, repr=False)
    log_file: IO | None = field(default=None, repr=False)
    started: float = 0.0
    steps_at_start: int = 0
    returncode: int | None = None

    def steps(self) -> int:
        return int(read_metrics(self.run_dir).get("total_steps") or 0) if self.run_dir.is_dir() else 0

    def progress(self) -> str:
        """``default seed 0: step 1250/5000 · val 0.352 (best 0.360) · 0:21:30 · ~1:04:00 left``."""
        metrics = read_metrics(self.run_dir) if self.run_dir.is_dir() else {}
        step = int(metrics.get("total_steps") or 0)
        parts = [f"{self.label}: step {step}/{self.max_steps}"]
        history = metrics.get("val_history") or []
        if history:
            parts.append(f"val {history[-1][1]:.3f} (best {metrics.get('best_val_acc') or 0:.3f})")
        elapsed = time.monotonic() - self.started
        parts.append(str(timedelta(seconds=int(elapsed))))
        done = step - self.steps_at_start
        if done > 0:
            parts.append(f"~{timedelta(seconds=int(elapsed * (self.max_steps - step) / done))} left")
        return " · ".join(parts)


def threads_env(threads: int | None) -> dict[str, str] | None:
    """The environment of a child process limited to ``threads`` intra-op threads (None: inherited)."""
    if threads is None:
        return None
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def _start(fit: Fit, threads: int) -> None:
    fit.log.parent.mkdir(parents=True, exist_ok=True)
    fit.log_file = fit.log.open("a")
    fit.log_file.write(f"$ {' '.join(fit.cmd)}\n")
    fit.log_file.flush()
    fit.steps_at_start = fit.steps()
    fit.started = time.monotonic()
    fit.process = subprocess.Popen(
        fit.cmd,
        stdout=fit.log_file,
        stderr=subprocess.STDOUT,
        env=threads_env(threads),
        start_new_session=True,
    )


def run_side_by_side(fits: list[Fit], jobs: int, threads: int, out: IO | None = None) -> list[Fit]:
    """Run ``fits`` at most ``jobs`` at a time; return them with their return codes (None: never
    started, after an interruption or a failure). A failed fit lets the running ones finish and
    starts no other; an interruption (SIGINT/SIGTERM) stops every running fit gracefully."""
    out = out or sys.stdout
    queue, running, done = list(fits), [], []
    stopping = {"signal": None}

    def stop(signum: int, _frame: object) -> None:
        stopping["signal"] = stopping["signal"] or signum
        for fit in running:
            if fit.process is not None and fit.process.poll() is None:
                fit.process.send_signal(signal.SIGINT)  # the fit saves last.ckpt after its step

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    console = Console(file=out)
    live = Live(console=console, auto_refresh=False, transient=False) if console.is_terminal else None
    shown: dict[str, str] = {}
    try:
        if live:
            live.start()
        while queue or running:
            failed = any(f.returncode not in (None, 0) for f in done)
            while queue and len(running) < jobs and stopping["signal"] is None and not failed:
                fit = queue.pop(0)
                _start(fit, threads)
                running.append(fit)
                _say(console, live, f"{fit.label}: started, log {fit.log}")
            if not running:
                break
            time.sleep(POLL_SECONDS)
            for fit in list(running):
                rc = fit.process.poll() if fit.process else None
                if rc is None:
                    continue
                fit.returncode = rc
                fit.log_file.close()
                running.remove(fit)
                done.append(fit)
                _say(
                    console,
                    live,
                    f"{fit.label}: {'finished' if rc == 0 else f'exit {rc}'} ({fit.progress()})",
                )
            lines = [fit.progress() for fit in running]
            if live:
                live.update(Group(*(Text(line) for line in lines)), refresh=True)
            else:
                for fit, line in zip(running, lines):
                    if shown.get(fit.label) != line.split(" · ")[0]:  # a new step count
                        shown[fit.label] = line.split(" · ")[0]
                        console.print(line, highlight=False, soft_wrap=True)
    finally:
        if live:
            live.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return fits


def _say(console: Console, live: Live | None, line: str) -> None:
    """A line that stays (above the live progress lines on a terminal)."""
    (live.console if live else console).print(line, highlight=False, soft_wrap=True)
