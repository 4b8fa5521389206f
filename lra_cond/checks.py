"""Ranges of the model, optimizer, trainer and seed options, checked once at the edge.

Each message names the option, its valid range and the value given, so a mistyped option is one
``error:`` line before anything is built or written (instead of a ValueError or ZeroDivisionError
from torch or Lightning in the middle of a run).
"""

from __future__ import annotations

import os
from typing import Any

from lra_cond.errors import UserError

MAX_SEED = 2**32 - 1  # numpy's seed range (seed_everything seeds numpy too)


def _positive(name: str, value: Any) -> None:
    if value <= 0:
        raise UserError(f"{name} must be positive, got {value}")


def check_model_args(
    *,
    lr: float,
    dim: int,
    depth: int,
    mlp_dim: int,
    warmup_steps: int,
    dropout: float,
    num_heads: int,
    head_dim: int | None,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    max_len: int | None,
) -> None:
    """The model's and AdamW's options (``LraModel`` calls this before building anything)."""
    for name, value in (("lr", lr), ("dim", dim), ("depth", depth), ("mlp_dim", mlp_dim)):
        _positive(f"model.{name}", value)
    if warmup_steps < 0:
        raise UserError(f"model.warmup_steps must be >= 0, got {warmup_steps}")
    if not 0.0 <= dropout < 1.0:
        raise UserError(f"model.dropout must be in [0, 1) (a probability), got {dropout}")
    _positive("model.num_heads", num_heads)
    if head_dim is not None:
        _positive("model.head_dim", head_dim)
    if max_len is not None:
        _positive("model.max_len", max_len)
    if weight_decay < 0:
        raise UserError(f"model.weight_decay must be >= 0, got {weight_decay}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise UserError(f"model.betas must be two numbers in [0, 1), e.g. [0.9, 0.999], got {list(betas)}")
    if eps <= 0:
        raise UserError(f"model.eps must be positive (AdamW divides by sqrt(v) + eps), got {eps}")


def check_seed(seed: Any) -> None:
    if isinstance(seed, bool):  # True: a random seed; False: no seeding
        return
    if not 0 <= seed <= MAX_SEED:
        raise UserError(f"seed_everything must be in 0..{MAX_SEED}, got {seed}")


def _fraction_or_count(name: str, value: Any, zero_ok: bool) -> None:
    """Lightning's ``limit_*_batches``: a whole number of batches, or a float fraction of them."""
    if value is None:
        return
    ok = (
        (0.0 <= value <= 1.0 if zero_ok else 0.0 < value <= 1.0)
        if isinstance(value, float)
        else value >= (0 if zero_ok else 1)
    )
    if not ok:
        count, fraction = (">= 0", "[0, 1]") if zero_ok else (">= 1", "(0, 1]")
        raise UserError(
            f"trainer.{name} must be a whole number of batches {count} or a fraction in {fraction}, "
            f"got {value}"
        )


# Set by a multi-node launcher: SLURM's job, or torchrun's rendezvous.
CLUSTER_ENV = ("SLURM_JOB_ID", "MASTER_ADDR", "NODE_RANK", "WORLD_SIZE")


def check_trainer_args(trainer: Any, fit: bool) -> None:
    """Trainer options Lightning accepts but that crash later or train nothing."""
    steps = trainer.get("max_steps")
    # -1 is Lightning's "no step limit" (max_epochs then ends the run); 0 would train nothing.
    if fit and steps is not None and (steps == 0 or steps < -1):
        raise UserError(f"trainer.max_steps must be positive (or -1 for no step limit), got {steps}")
    epochs = trainer.get("max_epochs")
    if fit and epochs is not None and (epochs == 0 or epochs < -1):
        raise UserError(f"trainer.max_epochs must be positive (or -1 for no epoch limit), got {epochs}")
    interval = trainer.get("val_check_interval")
    if interval is not None:
        wanted = (
            "trainer.val_check_interval must be a whole number of steps >= 1 or a fraction of an epoch "
            "in (0, 1]"
        )
        if isinstance(interval, bool) or not isinstance(interval, (int, float)):
            # A time-based cadence ("00:01:00", {"minutes": 1}): a resumed run could not repeat it,
            # and ResumeCheckpoint could not tell which steps validate.
            raise UserError(f"{wanted}, got {interval} (a time-based cadence is not supported)")
        if isinstance(interval, float) and not 0.0 < interval <= 1.0:
            raise UserError(f"{wanted}, got {interval}")
        if not isinstance(interval, float) and interval < 1:
            raise UserError(
                f"trainer.val_check_interval must be >= 1 (steps between validations), got {interval}"
            )
    every = trainer.get("check_val_every_n_epoch")
    if every is not None and every < 1:
        raise UserError(f"trainer.check_val_every_n_epoch must be >= 1 (or null), got {every}")
    nodes = trainer.get("num_nodes")
    if isinstance(nodes, int) and nodes > 1 and not any(os.environ.get(v) for v in CLUSTER_ENV):
        # Without a launcher's rendezvous variables, each node's process waits for the others forever.
        raise UserError(
            f"trainer.num_nodes {nodes} needs a cluster launcher (SLURM's srun, or torchrun setting "
            f"{', '.join(CLUSTER_ENV[1:])}); on one machine use --trainer.num_nodes 1 and "
            "--trainer.devices N"
        )
    accumulate = trainer.get("accumulate_grad_batches")
    if accumulate is not None and accumulate < 1:
        raise UserError(f"trainer.accumulate_grad_batches must be >= 1, got {accumulate}")
    log_every = trainer.get("log_every_n_steps")
    if log_every is not None and log_every < 0:
        raise UserError(f"trainer.log_every_n_steps must be >= 0, got {log_every}")
    sanity = trainer.get("num_sanity_val_steps")
    if sanity is not None and sanity < -1:
        raise UserError(f"trainer.num_sanity_val_steps must be >= 0 (or -1 for all), got {sanity}")
    clip = trainer.get("gradient_clip_val")
    if clip is not None and clip < 0:
        raise UserError(f"trainer.gradient_clip_val must be >= 0, got {clip}")
    _fraction_or_count("limit_train_batches", trainer.get("limit_train_batches"), zero_ok=not fit)
    for name in ("limit_val_batches", "limit_test_batches"):
        _fraction_or_count(name, trainer.get(name), zero_ok=True)


def validation_gap(trainer: Any) -> str | None:
    """Why a ``fit`` with these trainer options would never validate (so: no best checkpoint, no
    steps-to-target, a report without accuracies), or None when it validates."""
    limit = trainer.get("limit_val_batches")
    if limit is not None and not isinstance(limit, bool) and limit == 0:
        return "trainer.limit_val_batches is 0"
    interval, steps = trainer.get("val_check_interval"), trainer.get("max_steps")
    accumulate = trainer.get("accumulate_grad_batches") or 1
    by_steps = trainer.get("check_val_every_n_epoch") is None and type(interval) is int
    if by_steps and steps is not None and 0 < steps * accumulate < interval:
        return f"trainer.val_check_interval {interval} is more than trainer.max_steps {steps}"
    return None
