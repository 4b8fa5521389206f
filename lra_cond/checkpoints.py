"""``--ckpt_path`` files: read with one-line errors, compared with the command, relocated on resume;
and written so that no kill or full disk leaves a damaged one (``AtomicCheckpointIO``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lightning.pytorch.plugins.io import TorchCheckpointIO

from lra_cond.errors import UserError
from lra_cond.run_dir import LAST_CHECKPOINT

REQUIRED = ("state_dict", "hyper_parameters")


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint at ``path`` (tensors memory-mapped); a missing, truncated or foreign file is a
    one-line error."""
    p = Path(path)
    if p.is_dir():
        raise UserError(
            f"--ckpt_path {path} is a directory; point it at a .ckpt file (or use --ckpt_path last)"
        )
    if not p.is_file():
        raise UserError(
            f"--ckpt_path {path}: no such checkpoint file (use --ckpt_path last for the run's own)"
        )
    import torch

    try:
        try:
            ckpt = torch.load(p, map_location="cpu", weights_only=False, mmap=True)
        except Exception:  # not mmap-able (an old non-zip file, or a damaged one): say why without
            ckpt = torch.load(p, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated zip, not a torch file, ...: many exception types
        reason = " ".join(str(e).split())[:160] or type(e).__name__
        raise UserError(
            f"--ckpt_path {path} is not a readable checkpoint ({reason}); it may be truncated: "
            "point it at a complete .ckpt written by fit"
        ) from None
    missing = [k for k in REQUIRED if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise UserError(
            f"--ckpt_path {path} is not a checkpoint written by this suite's fit (it has no "
            f"{' or '.join(missing)}); point it at a run's checkpoints/*.ckpt"
        )
    return ckpt


def _plain(value: Any) -> Any:
    """JSON-comparable form (tuples -> lists, Namespaces -> dicts)."""
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    return json.loads(json.dumps(value, default=str, sort_keys=True))


def hparams_differences(
    saved: dict[str, Any], command: dict[str, Any], defaults: dict[str, Any]
) -> list[str]:
    """``model.KEY (checkpoint X, command Y)`` for every model option where they differ.

    A key the checkpoint lacks (written before the option existed) counts as its default.
    """
    out = []
    for key in sorted(command):
        if key.startswith("_"):
            continue
        mine = _plain(command[key])
        theirs = _plain(saved[key] if key in saved else defaults.get(key))
        if mine != theirs:
            out.append(f"model.{key} (checkpoint {json.dumps(theirs)}, command {json.dumps(mine)})")
    return out


def best_checkpoint_name(ckpt: dict[str, Any]) -> str | None:
    """File name of the best-by-validation checkpoint recorded in ``ckpt``'s callback state."""
    for key, state in (ckpt.get("callbacks") or {}).items():
        if (
            str(key).startswith("ModelCheckpoint")
            and isinstance(state, dict)
            and state.get("best_model_path")
        ):
            return os.path.basename(state["best_model_path"])
    return None


def relocate_callback_paths(checkpoint: dict[str, Any], dirpath: str) -> None:
    """Point every ModelCheckpoint state's paths at ``dirpath`` (the run folder was moved).

    Lightning keeps the best checkpoint's old path and drops its score when a checkpoint's folder
    changed, so a moved run would test a file from the old place and rank the next validation best.
    """
    for state in (checkpoint.get("callbacks") or {}).values():
        old = state.get("dirpath") if isinstance(state, dict) else None
        if not old or old == dirpath:
            continue

        def move(p: Any, old: str = old) -> Any:
            if isinstance(p, str) and p and os.path.dirname(p) == old:
                return os.path.join(dirpath, os.path.basename(p))
            return p

        for key in ("best_model_path", "kth_best_model_path", "last_model_path"):
            if key in state:
                state[key] = move(state[key])
        if isinstance(state.get("best_k_models"), dict):
            state["best_k_models"] = {move(k): v for k, v in state["best_k_models"].items()}
        state["dirpath"] = dirpath


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer for local paths, written through ``run_dir.write_atomic``: a
    temporary file beside the checkpoint, synced, then renamed. (Lightning's own writes to a
    temporary file in $TMPDIR and moves it, which is a copy, interruptible half-way, when the run
    root is on another filesystem.) Remote URLs (``s3://...``) keep Lightning's writer.

    A superseded best checkpoint is removed only once the next ``last.ckpt`` is on disk: until then
    the ``last.ckpt`` a kill would resume from still names it as the run's best."""

    def __init__(self) -> None:
        super().__init__()
        self._superseded: list[Path] = []

    def remove_checkpoint(self, path: Any) -> None:
        if "://" in str(path):
            return super().remove_checkpoint(path)
        self._superseded.append(Path(path))

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        self._write(checkpoint, path, storage_options)
        self._superseded = [p for p in self._superseded if p != Path(path)]  # written again: kept
        if Path(path).name == LAST_CHECKPOINT:
            for old in self._superseded:
                old.unlink(missing_ok=True)
            self._superseded = []

    def _write(self, checkpoint: dict[str, Any], path: Any, storage_options: Any) -> None:
        if storage_options is not None:
            raise TypeError("storage_options are not supported by AtomicCheckpointIO")
        import io

        import torch

        from lra_cond.run_dir import write_atomic

        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, buffer.getvalue())
