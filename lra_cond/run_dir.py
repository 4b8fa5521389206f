"""The run folder: one run = ``<run_root>/<group>/<attention>/<init>/seed<k>/``, where the group is
the task, then ``-<preset>`` unless the preset is ``full``, then ``-<run_name>`` when one is given
(``listops``, ``listops-tiny``, ``listops-lr3e-4``).

This module owns everything about it: the layout, the ``metrics.json`` schema and its one reader and
writer, ``config.yaml``, the single definition of a *finished* run, what state a folder is in, and
the lock that keeps a second writer out. The CLI (``fit``), the callbacks, ``compare`` and
``report`` all go through it.

Folder contents: TensorBoard events, ``hparams.yaml``, ``config.yaml`` (written once, when the run
starts training), ``checkpoints/`` (``best-step<N>.ckpt`` and ``last.ckpt``) and ``metrics.json``.
While a ``fit`` writes the folder it holds ``.lock`` (an ``flock``; a stale file left by a killed
process is not held and is not part of the run).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TypedDict

import yaml

from lra_cond.errors import UserError
from lra_cond.locks import FileLock, LockHeld

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.json"
CHECKPOINT_DIR = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"
LOCK_FILE = ".lock"
BEST_STEP = re.compile(r"best-step(\d+)\.ckpt")  # the best-by-validation checkpoint's file name
TEMP_SUFFIXES = (".tmp", ".part")  # atomic-write leftovers of a killed writer: not run files
SEED_DIR = re.compile(r"^seed(\d+)$")


# --- layout ----------------------------------------------------------------------------------------


RUN_NAME = re.compile(r"^[\w+=-][\w.+=-]*$")


def check_run_name(name: str | None) -> None:
    """A run name is one folder name: letters, digits and ``_ . + = -``, not starting with ``.``."""
    if name is not None and not RUN_NAME.match(name):
        raise UserError(
            f"run_name {name!r} must be one folder name (letters, digits, '_', '.', '+', '=', '-'; not "
            "starting with '.'), e.g. --run_name lr3e-4"
        )


def group_name(task: str, *, preset: str, name: str | None) -> str:
    """The folder of one study below the run root: the task, ``-<preset>`` unless it is ``full``,
    ``-<name>`` when a run name is given."""
    check_run_name(name)
    return "-".join([task, *([preset] if preset != "full" else []), *([name] if name else [])])


def run_name(task: str, attention: str, init: str, *, preset: str, name: str | None) -> str:
    """The folder of one init's runs below the run root (TensorBoard's ``name``)."""
    return f"{group_name(task, preset=preset, name=name)}/{attention}/{init}"


def seed_name(seed: int) -> str:
    """The folder of one seed (TensorBoard's ``version``)."""
    return f"seed{seed}"


def runs_dir(run_root: str | Path, task: str, attention: str, *, preset: str, name: str | None) -> Path:
    """The folder holding every init's runs of one study and attention (what ``compare`` fills)."""
    return Path(run_root) / group_name(task, preset=preset, name=name) / attention


def run_path(
    run_root: str | Path, task: str, attention: str, init: str, seed: int, *, preset: str, name: str | None
) -> Path:
    return Path(run_root) / run_name(task, attention, init, preset=preset, name=name) / seed_name(seed)


def seed_of(folder: str | Path) -> int | None:
    """The seed of a ``seed<k>`` folder name, or None for any other name."""
    match = SEED_DIR.match(Path(folder).name)
    return int(match.group(1)) if match else None


def last_checkpoint(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / LAST_CHECKPOINT


def run_dir_of(trainer: Any) -> str | None:
    """The run folder a trainer writes (its logger's folder), or None when it has no such logger.

    Not ``Trainer.log_dir``: that is a collective under DDP, and called on rank zero alone (as
    rank-zero writers do) it waits forever for the other ranks. The logger's folder is the same on
    every rank. A trainer without a TensorBoard/CSV logger (``validate``/``test``, ``fast_dev_run``)
    has no run folder, so nothing writes one.
    """
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    for logger in trainer.loggers:
        if isinstance(logger, (TensorBoardLogger, CSVLogger)):
            return logger.log_dir
    return None


# --- metrics.json ----------------------------------------------------------------------------------


class Metrics(TypedDict, total=False):
    """``metrics.json``: the run summary that ``compare`` and ``report`` read.

    Every key is optional (callbacks contribute them as the run goes); these are all the keys.
    """

    best_val_acc: float | None  # best validation accuracy (micro) and the step it was reached
    best_val_step: int | None
    val_history: list  # [[step, val acc], ...]
    total_steps: int  # optimizer steps trained
    total_epochs: float | None
    test_acc: float | None  # test accuracy of the tested (best) checkpoint: set once the run is done
    test_ckpt: str | None
    stopped: str  # why training stopped early (non-finite loss or gradient, Ctrl-C)
    data_sha256: str  # the prepared data the run started with (cache.data_sha256); a resume checks it
    target_acc: float | None  # EpochsToTarget
    target_source: str | None
    target_metric: str
    steps_to_target: int | None
    epochs_to_target: float | None
    target_reached_acc: float | None
    cond_history: list  # ConditionNumberMonitor: one entry per probe
    cond_settings: dict
    label_counts: dict  # {split: [examples of class 0, 1, ...]} of the validation and test splits
    seconds: float  # wall-clock seconds the fit spent (training, validations, probes; all its processes)
    machines: list  # the machines the fit ran on ("2 x AMD EPYC, 1 thread, torch 2.13.0+cpu")


METRIC_TYPES: dict[str, Any] = typing.get_type_hints(Metrics)


def _matches(value: Any, hint: Any) -> bool:
    """Shallow runtime check of a JSON value against a ``Metrics`` annotation."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, typing.get_origin(hint) or hint)


def read_metrics(run_dir: str | Path) -> Metrics:
    """``run_dir/metrics.json`` ({} when there is none); a damaged file is a one-line error."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); the run folder is damaged: move it away") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} is not a JSON object; the run folder is damaged: move it away")
    for key, value in data.items():
        if key in METRIC_TYPES and not _matches(value, METRIC_TYPES[key]):
            raise UserError(
                f"{path}: {key} = {value!r} is not a {METRIC_TYPES[key]}; the run folder is damaged: "
                "move it away"
            )
    return data  # type: ignore[return-value]


NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, a quota, a file size limit


def write_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a kill at any moment leaves either the old file or the new
    one: a temporary file in the same folder (a rename within one filesystem is atomic; one from
    $TMPDIR to a run root elsewhere is a copy), flushed to the disk, then renamed over ``path``.
    A full disk is one error line naming the folder and the space the file needs, and leaves no
    partial file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.errno in NO_SPACE:
            free = shutil.disk_usage(path.parent).free
            kept = f"the previous {path.name} is intact" if path.exists() else "no partial file is left"
            raise UserError(
                f"no space left to write {path.name} in {path.parent} ({os.strerror(e.errno).lower()}: it "
                f"needs {len(data) / 2**20:.1f} MB, {free / 2**20:.1f} MB are free); {kept}: free space "
                "there and continue with --ckpt_path last"
            ) from None
        raise
    try:  # the rename itself reaches the disk with the folder's entry
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass  # a filesystem that cannot sync a folder still renamed atomically


def _write_atomic(path: Path, text: str) -> None:
    write_atomic(path, text.encode())


def update_metrics(run_dir: str | Path, *, drop: tuple[str, ...] = (), **entries: Any) -> Path:
    """Merge ``entries`` into ``run_dir/metrics.json`` (and remove the ``drop`` keys), atomically.

    Only ``Metrics`` keys are accepted: a new key is added to the schema above first.
    """
    unknown = sorted(set(entries) - set(METRIC_TYPES))
    if unknown:
        raise KeyError(f"metrics.json has no key {', '.join(unknown)}: add it to lra_cond.run_dir.Metrics")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    data = {k: v for k, v in read_metrics(run_dir).items() if k not in drop}
    data.update(entries)
    path = run_dir / METRICS_FILE
    _write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def is_finished(metrics: Metrics) -> bool:
    """The one definition of a finished run: it trained, was not stopped, and was tested.

    ``compare`` reuses finished runs and ``report`` marks the others "not finished".
    """
    return (
        metrics.get("test_acc") is not None
        and (metrics.get("total_steps") or 0) > 0
        and not metrics.get("stopped")
    )


# --- config.yaml -----------------------------------------------------------------------------------


def read_config(run_dir: str | Path) -> dict[str, Any]:
    """``run_dir/config.yaml`` as a dict ({} when there is none); a damaged file is a one-line error."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        data = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        reason = " ".join(str(e).split())
        raise UserError(
            f"{path} is not valid YAML ({reason}); the run folder is damaged: move it away"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path} is not a YAML mapping; the run folder is damaged: move it away")
    return data


def write_config(run_dir: str | Path, text: str) -> Path:
    path = Path(run_dir) / CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, text)
    return path


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> ``{"a.b.c": value}`` (lists are kept as leaves)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        out.update(flatten(value, name) if isinstance(value, dict) and value else {name: value})
    return out


def _covered(key: str, keys: tuple[str, ...]) -> bool:
    return any(key == k or key.startswith(k + ".") for k in keys)


def config_value(config: dict[str, Any], key: str) -> Any:
    """The value at a dotted ``key`` (``model.lr``) of a config, None where it has none."""
    node: Any = config
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def config_differences(
    a: dict[str, Any],
    b: dict[str, Any],
    ignored: tuple[str, ...] = (),
    defaults: dict[str, Any] | None = None,
) -> list[str]:
    """Dotted keys whose values differ between two configs, apart from the ``ignored`` ones. A key
    one config lacks (an option added to the suite after that run started) counts as its value in
    ``defaults``, the options' defaults: a run from before the option behaved as its default."""
    fa, fb, fd = flatten(a), flatten(b), flatten(defaults or {})
    keys = sorted(k for k in set(fa) | set(fb) if not _covered(k, ignored))
    missing = "<missing>"
    return [k for k in keys if fa.get(k, fd.get(k, missing)) != fb.get(k, fd.get(k, missing))]


# What a resume (``fit --ckpt_path last``) may change: how the run is executed and watched, never
# what it computes. Everything else in config.yaml (model, optimizer, schedule, steps, batch, data
# preset and length, precision, devices, seed, the κ monitor and the target) must be the same as
# when the run started; the model's options are also checked against the checkpoint itself.
RESUME_MAY_CHANGE = (
    "ckpt_path",
    "config",  # the paths of the YAML files (e.g. another checkout); their values are compared
    "run_root",  # the folder may have been moved
    "run_name",  # ... or renamed
    "data.data_dir",  # the same prepared data at another place (e.g. node-local scratch)
    "data.num_workers",
    "checkpoint_every",
    "trainer.callbacks",
    "trainer.enable_progress_bar",
    "trainer.enable_model_summary",
    "trainer.log_every_n_steps",
)


# --- what a folder holds ---------------------------------------------------------------------------


class State(str, Enum):
    EMPTY = "empty"  # nothing of a run (no folder, or only a stale lock file / temp files)
    STARTED = "started"  # run files but no last.ckpt: stopped before its first checkpoint
    UNFINISHED = "unfinished"  # last.ckpt and not finished: resume with --ckpt_path last
    FINISHED = "finished"  # see is_finished


def _is_run_file(rel: Path) -> bool:
    return rel.name != LOCK_FILE and not rel.name.endswith(TEMP_SUFFIXES)


@dataclass
class RunFolder:
    """One run folder: its state, its lock, and the clean-up of a command that failed early."""

    path: Path
    _lock: FileLock | None = field(default=None, repr=False)
    _created: list[Path] = field(default_factory=list, repr=False)
    _before: set[str] = field(default_factory=set, repr=False)
    _dirs: set[Path] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        self.path = Path(self.path)

    @property
    def metrics(self) -> Metrics:
        return read_metrics(self.path)

    @property
    def config(self) -> dict[str, Any]:
        return read_config(self.path)

    @property
    def last_checkpoint(self) -> Path:
        return last_checkpoint(self.path)

    def files(self) -> set[str]:
        """Relative paths of the run's files (not the lock file or temp files)."""
        if not self.path.is_dir():
            return set()
        return {
            p.relative_to(self.path).as_posix()
            for p in self.path.rglob("*")
            if p.is_file() and _is_run_file(p.relative_to(self.path))
        }

    def state(self) -> State:
        if is_finished(self.metrics):
            return State.FINISHED
        if self.last_checkpoint.is_file():
            return State.UNFINISHED
        return State.STARTED if self.files() else State.EMPTY

    def describe(self) -> str:
        """A few words on what the folder holds, for error messages."""
        state, metrics = self.state(), self.metrics
        if state is State.FINISHED:
            acc, steps = metrics["test_acc"], metrics["total_steps"]
            return f"a finished run (test accuracy {acc:.4f} after {steps} steps)"
        if state is State.UNFINISHED:
            return "an unfinished run with a last checkpoint"
        if metrics.get("stopped"):
            return f"a run that stopped before its first checkpoint ({metrics['stopped']})"
        return "files of a run that stopped before its first checkpoint"

    # --- the lock ---------------------------------------------------------------------------------

    def lock(self) -> None:
        """Hold the folder's lock (creating the folder); a second writer gets a one-line error."""
        missing = []
        p = self.path
        while not p.exists():
            missing.append(p)
            p = p.parent
        self.path.mkdir(parents=True, exist_ok=True)
        self._created = missing  # deepest first
        lock = FileLock(self.path / LOCK_FILE)
        try:
            lock.acquire(blocking=False)
        except LockHeld as e:
            who = f"process {e.pid}" if e.pid else "another process"
            raise UserError(
                f"{who} is writing {self.path} (it holds {self.path / LOCK_FILE}); wait for it to finish, "
                "or start this run elsewhere with --run_root DIR"
            ) from None
        self._lock = lock
        self._before = self.files()
        self._dirs = {p for p in self.path.rglob("*") if p.is_dir()}

    def restartable(self) -> bool:
        """A run that stopped before its first checkpoint for a reason that does not repeat (a kill,
        a signal, a crash), not one the NaN guard stopped: the same command may start it again."""
        stopped = self.metrics.get("stopped") or ""
        return self.state() is State.STARTED and (not stopped or stopped.startswith("interrupted"))

    def clear(self) -> None:
        """Remove every file of the run (under the lock): what a run that stopped before its first
        checkpoint left, when the same command starts it again."""
        for rel in sorted(self.files()):
            (self.path / rel).unlink(missing_ok=True)
        self.discard_after(-1)  # and the temporary files of its killed writer
        self._before = set()

    def discard_after(self, step: int) -> list[str]:
        """Before resuming from the checkpoint of ``step``: remove what the killed process left that
        the resumed run does not continue from (its half-written temporary files, and best
        checkpoints of later steps, which the resumed run writes again when it gets there).
        Returns the removed files' relative paths."""
        removed = []
        for p in sorted(self.path.rglob("*")):
            later = BEST_STEP.fullmatch(p.name)
            if p.is_file() and (p.name.endswith(TEMP_SUFFIXES) or (later and int(later[1]) > step)):
                p.unlink()
                removed.append(p.relative_to(self.path).as_posix())
        return removed

    def mark_training(self) -> None:
        """Record in the lock file that training started (any process of the run may call this)."""
        with open(self.path / LOCK_FILE, "a") as f:
            f.write("training\n")

    def training_started(self) -> bool:
        try:
            return "training" in (self.path / LOCK_FILE).read_text().split()
        except OSError:
            return False

    def unlock(self, discard_new_files: bool = False) -> None:
        """Release the lock; with ``discard_new_files``, first remove every file this command created
        (a command that failed before training leaves the folder as it found it)."""
        if self._lock is None:
            return
        try:
            if discard_new_files:
                for rel in sorted(self.files() - self._before):
                    (self.path / rel).unlink(missing_ok=True)
                new_dirs = {p for p in self.path.rglob("*") if p.is_dir()} - self._dirs
                for d in sorted(new_dirs, key=lambda p: len(p.parts), reverse=True):
                    if not any(d.iterdir()):
                        d.rmdir()
        finally:
            self._lock.release()
            self._lock = None
        for d in self._created:  # folders this command made, if nothing else is in them now
            try:
                d.rmdir()
            except OSError:
                break
