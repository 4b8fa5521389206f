"""Tracks the attention Jacobian's condition number (and the weights') during training.

At step 0 (before any update) and every ``every_n_steps`` optimizer steps, the model is copied to
float64/eval, a fixed probe batch from the validation set is run through the copy, each attention
layer's input (after its LayerNorm) is captured with a forward hook, and
:func:`lra_cond.conditioning.jacobian_condition` measures that layer. Training weights and modes are
never touched. Runs from ``on_train_batch_start`` (validation runs under inference mode, where no
Jacobian can be taken), on rank zero only, never during the sanity check.
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl
import torch
from rich.console import Console

from lra_cond.callbacks.epochs import epochs_at
from lra_cond.callbacks.layer_inputs import capture_layer_inputs, float64_copy, take_probe_batch
from lra_cond.conditioning import (
    DEFINITION,
    UNSEPARATED,
    JacobianCondition,
    cut_separated,
    jacobian_condition,
)
from lra_cond.conditioning.jacobian import DEFAULT_RTOL, METHODS
from lra_cond.errors import UserError
from lra_cond.heap import heap_kept
from lra_cond.models.attention.base import attention_layers
from lra_cond.run_dir import run_dir_of, update_metrics

# Sized on the measured probe cost (docs/conditioning.md): a few seconds per probe at the
# ListOps reference shape, under 2% of training for every family at the ListOps config's batch 32.
DEFAULT_EVERY_N_STEPS = 1500
# 256 tokens is a probe of seconds; 2048 already forms 65536-row Jacobians per head (minutes, GBs).
MAX_PROBE_TOKENS = 2048


class ConditionNumberMonitor(pl.Callback):
    """Condition number of each attention layer's Jacobian d A / d theta_qkv during ``fit``.

    theta_qkv is every parameter of the q, k, v projections (weights and biases): see
    ``lra_cond.conditioning.jacobian`` for the definition and why. On by default; one probe at the
    ListOps reference shape (dim 64, 2 layers, 2 heads x 32, 256 probe tokens, per-block values
    included) takes seconds on a 2-core CPU with the default ``gram`` method (docs/conditioning.md
    has the measurements). kappa depends on the probe size (J is 8192 x 6240 per head at
    256 tokens), so compare runs only at equal ``probe_tokens``. A short run still pays the probes
    at step 0 and at the end: ``--cond.every_n_steps 0`` disables the monitor.

    Args:
        every_n_steps: measure at step 0 and every this many optimizer steps (and at the end of
            training); 0 disables the monitor.
        method: ``gram`` (preconditioned Gram + Cholesky, checked against the exact J, QR when the
            check fails; exact to ~1e-8), ``qr`` (the same with Householder QR) or ``dense`` (full
            svdvals; the reference, minutes per layer).
        probe_tokens: the probe is the first validation examples, each cropped to this many tokens,
            as many as bring their real tokens closest to it (it must reach 3 * (dim + 1) for a
            full-rank J); a pair task's two documents count together, each cropped to half.
        per_block: also measure the Q, K and V blocks alone.
        rtol: singular values below rtol * sigma_max count as null.
    """

    def __init__(
        self,
        every_n_steps: int = DEFAULT_EVERY_N_STEPS,
        method: str = "gram",
        probe_tokens: int = 256,
        per_block: bool = True,
        rtol: float = DEFAULT_RTOL,
    ) -> None:
        if every_n_steps < 0:
            raise UserError(f"cond.every_n_steps must be >= 0 (0 disables), got {every_n_steps}")
        if method not in METHODS:
            raise UserError(f"cond.method must be one of {', '.join(METHODS)}, got '{method}'")
        if not 0 < probe_tokens <= MAX_PROBE_TOKENS:
            raise UserError(
                f"cond.probe_tokens must be in 1..{MAX_PROBE_TOKENS}, got {probe_tokens} (a probe's Jacobian "
                "has tokens x head_dim rows per head: its time and memory grow faster than the tokens)"
            )
        if not 0.0 < rtol < 1e-3:
            raise UserError(
                f"cond.rtol must be in (0, 1e-3) (singular values below rtol x the largest are null), "
                f"got {rtol}"
            )
        self.every_n_steps = every_n_steps
        self.method = method
        self.probe_tokens = probe_tokens
        self.per_block = per_block
        self.rtol = rtol
        self.history: list[dict[str, Any]] = []
        self._probe: dict[str, torch.Tensor] | None = None
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self.every_n_steps > 0

    def _measured(self, step: int) -> bool:
        return any(h["step"] == step for h in self.history)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *_: Any
    ) -> None:
        step = trainer.global_step
        if self.enabled and step % self.every_n_steps == 0 and not self._measured(step):
            self.measure(trainer, pl_module, batch)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.enabled and not self._measured(trainer.global_step):
            self.measure(trainer, pl_module, None)

    def _probe_batch(self, trainer: pl.Trainer, fallback: Any) -> dict[str, torch.Tensor]:
        if self._probe is None:
            loader = None
            datamodule = getattr(trainer, "datamodule", None)
            if datamodule is not None and hasattr(datamodule, "probe_dataloader"):
                loader = datamodule.probe_dataloader()  # the validation split in its own order
            elif datamodule is not None and hasattr(datamodule, "val_dataloader"):
                loader = datamodule.val_dataloader()
            elif trainer.val_dataloaders is not None:
                loader = trainer.val_dataloaders
            if loader is None:
                Console(stderr=True).print(
                    "[yellow]warning:[/] no validation data for the condition-number probe; "
                    "using the first training batch"
                )
                loader = [fallback]
            self._probe = take_probe_batch(loader, self.probe_tokens)
        return self._probe

    @torch.inference_mode(False)
    @torch.enable_grad()
    def measure(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any
    ) -> dict[str, Any] | None:
        """Measure every attention layer now; log, record and return the history entry."""
        if trainer.sanity_checking or not trainer.is_global_zero:
            return None
        was_training = pl_module.training
        # A status line: the progress bar stands still for the probe's seconds.
        console = Console(stderr=True, soft_wrap=True, highlight=False)  # one line each, also in logs
        n = len(attention_layers(pl_module))
        what = f"condition number of {n} attention layer{'s' * (n != 1)} at step {trainer.global_step}"
        console.print(f"measuring the {what} (probe {self.probe_tokens} tokens, {self.method})...")
        start = time.perf_counter()
        try:
            results = self.measure_layers(pl_module, self._probe_batch(trainer, batch))
        finally:
            pl_module.train(was_training)
        entry = self._entry(trainer, results, time.perf_counter() - start)
        console.print(f"measured the {what} in {entry['seconds']:.1f} s")
        self.history.append(entry)
        self._log(trainer, entry)
        return entry

    @torch.inference_mode(False)
    @torch.enable_grad()
    def measure_layers(
        self, model: torch.nn.Module, probe: dict[str, torch.Tensor]
    ) -> list[JacobianCondition]:
        """Measure every attention layer of ``model`` on ``probe`` (a batch dict) with this monitor's
        settings; ``model`` is copied to float64 and never touched. Also what ``bench`` times."""
        copy64 = float64_copy(model)
        device = next(model.parameters()).device
        layers = capture_layer_inputs(copy64, {k: v.to(device) for k, v in probe.items()})
        with heap_kept():  # its 50-75 MB blocks reused, not mapped afresh (``lra_cond.heap``)
            settings = {"method": self.method, "per_block": self.per_block, "rtol": self.rtol}
            return [jacobian_condition(layer, x, mask, **settings) for layer, x, mask in layers]

    def _entry(self, trainer: pl.Trainer, results: list, seconds: float) -> dict[str, Any]:
        epoch = epochs_at(trainer)
        layers = []
        for r in results:
            layers.append(
                {
                    "kappa": r.kappa,
                    "sigma_max": r.sigma_max,
                    "sigma_min": r.sigma_min,
                    "n_null": r.n_null,
                    "n_null_expected": r.n_null_expected,
                    "null_groups": r.null_groups,
                    "cut_separation": r.cut_separation,
                    "cut_separated": cut_separated(r.cut_separation),
                    "kappa_blocks": {b: s.kappa for b, s in r.per_block.items()},
                    "kappa_x": r.kappa_x,
                    "n_null_x": r.n_null_x,
                    "weights": r.weights,
                    "n_tokens": r.n_tokens,
                    "reason": r.reason,
                    "notes": r.notes,
                }
            )
            if r.reason and not self._warned:
                Console(stderr=True).print(f"[yellow]warning:[/] condition number not measured: {r.reason}")
                self._warned = True
            if not r.reason and not layers[-1]["cut_separated"]:
                Console(stderr=True).print(
                    f"[yellow]warning:[/] step {trainer.global_step}, layer {len(layers) - 1}: {UNSEPARATED} "
                    f"(sigma_min {r.sigma_min:.3g}, largest excluded {r.null_gain:.3g}; docs/conditioning.md)"
                )
        kappas = [r.kappa for r in results if r.kappa is not None]
        return {
            "step": trainer.global_step,
            "epoch": epoch,
            "kappa_mean": sum(kappas) / len(kappas) if kappas else None,
            "layers": layers,
            "seconds": seconds,
        }

    @staticmethod
    def scalars(entry: dict[str, Any]) -> dict[str, float]:
        """TensorBoard scalars of one history entry. ``cond/``: what the curves are for (kappa of J,
        of each block, of the probe input X, of the stacked weights; each also as log10 so the
        curves read on one linear axis); ``cond_diag/``: how the measurement went (null counts,
        seconds, per-head weight kappas, the decades between sigma_min and what the cut excluded)."""
        out: dict[str, float] = {}

        def put(name: str, value: float | None) -> None:
            if value is not None and math.isfinite(value) and value > 0:
                out[f"cond/{name}"] = value
                out[f"cond/log10_{name}"] = math.log10(value)

        for i, layer in enumerate(entry["layers"]):
            put(f"kappa/layer{i}", layer["kappa"])
            for b, k in layer["kappa_blocks"].items():
                put(f"kappa_{b}/layer{i}", k)
            put(f"kappa_x/layer{i}", layer.get("kappa_x"))
            for b, w in layer["weights"].items():
                put(f"weights/{b}/layer{i}", w["stacked"])
                for h, k in enumerate(w["heads"]):
                    if math.isfinite(k):
                        out[f"cond_diag/weights/{b}_head{h}/layer{i}"] = k
            if layer["kappa"] is not None:
                out[f"cond_diag/n_null/layer{i}"] = layer["n_null"]
                out[f"cond_diag/n_null_unexplained/layer{i}"] = layer["n_null"] - layer["n_null_expected"]
            if layer.get("cut_separation") is not None:
                out[f"cond_diag/cut_separation/layer{i}"] = layer["cut_separation"]
        put("kappa/mean", entry["kappa_mean"])
        out["cond_diag/seconds"] = entry["seconds"]
        return out

    def _log(self, trainer: pl.Trainer, entry: dict[str, Any]) -> None:
        metrics = self.scalars(entry)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=entry["step"])
        if run_dir_of(trainer):
            update_metrics(
                run_dir_of(trainer),
                cond_history=self.history,
                cond_settings={
                    "method": self.method,
                    "probe_tokens": self.probe_tokens,
                    "rtol": self.rtol,
                    "every_n_steps": self.every_n_steps,
                    "definition": DEFINITION,
                },
            )

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))
