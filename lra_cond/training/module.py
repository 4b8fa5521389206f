"""LightningModule: the LRA classifier, its init, optimizer and schedule."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torchmetrics.classification import MulticlassAccuracy

from lra_cond.checks import check_model_args
from lra_cond.data.documents import document_keys
from lra_cond.data.tasks import TASKS
from lra_cond.errors import UserError
from lra_cond.init import INITS, apply_init
from lra_cond.models.attention import ATTENTIONS
from lra_cond.models.encoder import Classifier, EncoderConfig, PairClassifier

SCHEDULES = ("onecycle", "warmup_linear")


def warmup_linear(step: int, warmup: int, total: int) -> float:
    """LR multiplier of the ``warmup_linear`` schedule: linear warm-up to 1 over ``warmup`` steps,
    then linear anneal to 0 at ``total``; betas stay fixed."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


def check_schedule(warmup_steps: int, total: float, source: str, schedule: str = "onecycle") -> int:
    """The schedule's length in optimizer steps, or a ``UserError`` if no schedule fits it.

    ``total`` is the number of steps training will run (``inf`` without a step or epoch limit);
    ``source`` says where it came from, for the message.
    """
    if schedule == "onecycle" and warmup_steps == 1:
        # OneCycleLR's rise spans steps 0 .. warmup_steps - 1: one step long, it divides by zero.
        raise UserError(
            "model.warmup_steps=1 leaves the onecycle schedule no rise (it goes from lr / 25 at step 0 "
            "to lr at step warmup_steps - 1); use --model.warmup_steps 0 or 2 or more"
        )
    if total == float("inf"):
        raise UserError(
            "the lr schedule needs a finite number of training steps, but neither trainer.max_steps "
            "nor trainer.max_epochs limits the run; set --trainer.max_steps N"
        )
    total = int(total)
    if warmup_steps >= total:
        raise UserError(
            f"model.warmup_steps={warmup_steps} must be less than the {total} training steps ({source}); "
            "lower --model.warmup_steps or raise --trainer.max_steps"
        )
    return total


class LraModel(pl.LightningModule):
    """LRA classifier.

    Args:
        task: LRA task (linked from ``data.task``); sets vocabulary, classes and max length, and
            for pair tasks (retrieval) the shared-weight dual encoder.
        attention: attention family name.
        init: init scheme name.
        init_args: keyword arguments of the init scheme.
        attention_args: keyword arguments of the attention family (e.g. num_landmarks).
        dim: embedding width.
        depth: number of Transformer blocks.
        num_heads: attention heads.
        head_dim: per-head width; default dim // num_heads.
        mlp_dim: hidden width of the block MLPs and the classifier head.
        dropout: dropout rate (embeddings, attention probabilities, residual branches).
        max_len: positional table size; default the task's maximum length (the CLI sets it from
            ``data.max_len``).
        pool_length: None (default) pools the mean over each example's real tokens; N divides their
            sum by N, as the reference code does by mean-pooling a batch padded to N (2048 for
            ListOps), which scales an example's features by its length / N.
        lr: peak learning rate.
        warmup_steps: steps of the rising part of the schedule; must be less than the training
            steps (``trainer.max_steps``, or ``max_epochs`` x batches per epoch when it is -1).
        schedule: the learning-rate schedule, stepped after every optimizer step over the run's
            training steps T. ``onecycle`` (default; the reference's): torch's ``OneCycleLR(max_lr=lr,
            total_steps=T, pct_start=warmup_steps / T, anneal_strategy="linear")`` with torch's
            other defaults: lr rises linearly from lr / 25 at step 0 to lr at step warmup_steps - 1,
            then falls linearly to lr / 25 / 1e4 at the last step (T - 1), while AdamW's beta1
            cycles the other way, 0.95 -> 0.85 -> 0.95 (so ``betas[0]`` is not used).
            ``warmup_linear``: lr rises linearly from lr / warmup_steps at step 0 to lr at step
            warmup_steps - 1, then falls linearly towards 0 at step T; betas fixed.
        weight_decay: AdamW weight decay.
        betas: AdamW betas (with ``schedule=onecycle`` beta1 follows the schedule).
        eps: AdamW epsilon.
    """

    def __init__(
        self,
        task: str = "listops",
        attention: str = EncoderConfig.attention,
        init: str = "default",
        init_args: dict[str, Any] | None = None,
        attention_args: dict[str, Any] | None = None,
        dim: int = EncoderConfig.dim,
        depth: int = EncoderConfig.depth,
        num_heads: int = EncoderConfig.num_heads,
        head_dim: int | None = EncoderConfig.head_dim,
        mlp_dim: int = EncoderConfig.mlp_dim,
        dropout: float = EncoderConfig.dropout,
        max_len: int | None = None,
        pool_length: int | None = None,
        lr: float = 1e-4,
        warmup_steps: int = 1000,
        schedule: str = "onecycle",
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        spec = TASKS.get(task)
        ATTENTIONS.get(attention)
        INITS.get(init)
        check_model_args(
            lr=lr, dim=dim, depth=depth, mlp_dim=mlp_dim, warmup_steps=warmup_steps, dropout=dropout,
            num_heads=num_heads, head_dim=head_dim, weight_decay=weight_decay, betas=betas, eps=eps,
            max_len=max_len,
        )  # fmt: skip
        if pool_length is not None and pool_length <= 0:
            raise UserError(
                f"model.pool_length must be positive (or null: the real tokens), got {pool_length}"
            )
        if schedule not in SCHEDULES:
            raise UserError(f"unknown schedule '{schedule}'; valid schedules: {', '.join(SCHEDULES)}")
        self.save_hyperparameters()
        self.cfg = EncoderConfig(
            vocab_size=spec.vocab_size,
            max_len=max_len or spec.max_len,
            num_classes=spec.num_classes,
            dim=dim,
            depth=depth,
            num_heads=num_heads,
            head_dim=head_dim,
            mlp_dim=mlp_dim,
            dropout=dropout,
            attention=attention,
            attention_options=dict(attention_args or {}),
            pool_length=pool_length,
        )
        self.pair = spec.pair
        self.net = PairClassifier(self.cfg) if spec.pair else Classifier(self.cfg)
        apply_init(self.net, init, **(init_args or {}))
        self.val_acc = MulticlassAccuracy(spec.num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(spec.num_classes, average="micro")

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.net(*(batch[key] for doc in document_keys(self.pair) for key in doc))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self(batch), batch["label"])
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def _eval_step(self, batch: dict[str, torch.Tensor], split: str, metric: MulticlassAccuracy) -> None:
        logits = self(batch)
        self.log(f"{split}/loss", F.cross_entropy(logits, batch["label"]), sync_dist=True)
        metric.update(logits, batch["label"])
        self.log(f"{split}/acc", metric, prog_bar=True)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "val", self.val_acc)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "test", self.test_acc)

    def make_optimizer(self) -> torch.optim.Optimizer:
        """The training optimizer (also used by ``python -m lra_cond bench``)."""
        hp = self.hparams
        return torch.optim.AdamW(
            self.parameters(), lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps, weight_decay=hp.weight_decay
        )

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        opt = self.make_optimizer()
        # The steps this fit will run: max_steps, or max_epochs x batches per epoch if that is fewer.
        steps = self.trainer.estimated_stepping_batches
        source = "trainer.max_steps" if steps == self.trainer.max_steps else "max_epochs x batches per epoch"
        total = check_schedule(hp.warmup_steps, steps, source, hp.schedule)
        if hp.schedule == "onecycle":
            sched = torch.optim.lr_scheduler.OneCycleLR(
                opt,
                max_lr=hp.lr,
                total_steps=total,
                pct_start=hp.warmup_steps / total,
                anneal_strategy="linear",
            )
        else:
            sched = torch.optim.lr_scheduler.LambdaLR(
                opt, lambda step: warmup_linear(step, hp.warmup_steps, total)
            )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
