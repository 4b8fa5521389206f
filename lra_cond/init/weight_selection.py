"""``weight-selection`` (Xu et al. 2023, "Initializing models with larger ones").

The student (the model being initialised) copies a subset of a larger teacher's weights:
  * layers: the student's N blocks take the teacher's first N blocks (tensors are matched by name,
    so ``encoder.blocks.i.*`` comes from teacher block i; extra teacher blocks are ignored);
  * every student tensor takes the same-named teacher tensor (a missing one is an error);
  * along every dimension of size S (student) <= T (teacher), elements are selected uniformly:
    indices ``arange(S) * (T // S)`` when S divides T, else ``round(linspace(0, T-1, S))``. The
    indices are a function of (T, S) only, so a given dimension (e.g. the model width) is cut with
    the same indices in every tensor and the residual-stream channels stay aligned;
  * head structure (from the attention contract): the q/k/v rows (weights and biases) and the
    out_proj input columns are cut per head block, so heads never mix: student head j takes teacher
    head ``uniform(H_t, H_s)[j]`` and, inside it, dims ``uniform(d_t, d_s)``. A family's other
    per-head tensors (an axis of size H, e.g. a per-head temperature or conv kernel) get the
    generic ``uniform(H_t, H_s)`` on that axis, i.e. the same heads.
The teacher is a Lightning ``.ckpt`` of an ``LraModel`` (``state_dict`` keys start with ``net.``,
its head count comes from the checkpoint's hyper-parameters) or a plain ``state_dict`` ``.pt``
(with or without the ``net.`` prefix; pass ``teacher_heads``). Tensors are cast to the student's
dtype. With the same task, vocabulary, positions and classes have equal sizes and are copied whole.
The retrieval head's [e1, e2, e1*e2, e1-e2] input axis (4*D) stays block-aligned when D_s divides
D_t (the stride then matches the width's); otherwise its rounded spacing drifts across blocks.
The teacher file is read whenever the model is constructed, so re-instantiating a student from its
config (e.g. ``LraModel.load_from_checkpoint``) needs the teacher path to still exist.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lra_cond.errors import UserError
from lra_cond.init.base import INITS
from lra_cond.models.attention.base import attention_layers

PREFIX = "net."  # LraModel keeps the Classifier under ``net``


def uniform_indices(teacher: int, student: int) -> torch.Tensor:
    """``student`` evenly spaced indices into ``range(teacher)`` (student <= teacher)."""
    if teacher % student == 0:
        return torch.arange(student) * (teacher // student)
    return torch.linspace(0, teacher - 1, student).round().long()


def head_indices(teacher_heads: int, teacher_dim: int, student_heads: int, student_dim: int) -> torch.Tensor:
    """Rows of a stacked (heads*head_dim) axis: selected heads, selected dims within each head."""
    heads = uniform_indices(teacher_heads, student_heads)
    dims = uniform_indices(teacher_dim, student_dim)
    return (heads[:, None] * teacher_dim + dims[None, :]).reshape(-1)


def _strip(key: str) -> str:
    return key[len(PREFIX) :] if key.startswith(PREFIX) else key


def load_teacher(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state_dict without the ``net.`` prefix, hyper-parameters or {}) from a .ckpt or .pt file."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"weight-selection: teacher checkpoint not found: {p}")
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  (any unreadable file is the user's to fix)
        raise UserError(
            f"weight-selection: cannot read teacher checkpoint {p}: {str(e).splitlines()[0]}"
        ) from None
    hparams: dict[str, Any] = {}
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        hparams = dict(obj.get("hyper_parameters") or {})
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not any(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UserError(f"weight-selection: {p} holds neither a Lightning checkpoint nor a state_dict")
    return {_strip(k): v for k, v in obj.items() if isinstance(v, torch.Tensor)}, hparams


def _head_axes(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """Student tensor name -> (head-structured axis, student heads, student head_dim)."""
    axes: dict[str, tuple[int, int, int]] = {}
    for name, layer in attention_layers(model):
        pre = f"{name}." if name else ""
        info = (layer.num_heads, layer.head_dim)
        for proj in ("q_proj", "k_proj", "v_proj"):
            axes[f"{pre}{proj}.weight"] = (0, *info)
            axes[f"{pre}{proj}.bias"] = (0, *info)
        axes[f"{pre}out_proj.weight"] = (1, *info)
    return axes


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(map(str, t.shape)) + ")"


def select_tensor(
    key: str,
    teacher: torch.Tensor,
    student: torch.Tensor,
    head_axis: tuple[int, int, int] | None,
    teacher_heads: int,
) -> torch.Tensor:
    """The teacher's uniformly selected slice with the student's shape (heads cut per block)."""
    too_small = f"teacher tensor '{key}' has shape {_shape(teacher)} but the student needs {_shape(student)}"
    if teacher.dim() != student.dim() or any(t < s for t, s in zip(teacher.shape, student.shape)):
        raise UserError(
            f"weight-selection: {too_small}; the teacher must be at least as large in every dimension"
        )
    out = teacher
    for axis, (t, s) in enumerate(zip(teacher.shape, student.shape)):
        if head_axis is not None and axis == head_axis[0]:
            heads, head_dim = head_axis[1], head_axis[2]
            if t % teacher_heads or teacher_heads < heads or t // teacher_heads < head_dim:
                raise UserError(
                    f"weight-selection: teacher tensor '{key}' has shape {_shape(teacher)} "
                    f"(axis {axis} = {teacher_heads} heads) but the student needs {_shape(student)} "
                    f"(axis {axis} = {heads} heads x {head_dim}); the teacher needs at least as many "
                    "heads, each at least as wide"
                )
            idx = head_indices(teacher_heads, t // teacher_heads, heads, head_dim)
        else:
            idx = uniform_indices(t, s)
        out = out.index_select(axis, idx)
    return out


@INITS.register("weight-selection")
@torch.no_grad()
def weight_selection_init(model: nn.Module, checkpoint: str, teacher_heads: int | None = None) -> None:
    """Copy uniformly selected slices of a larger teacher's first layers into ``model``.

    ``checkpoint``: a Lightning .ckpt of an LraModel or a plain state_dict .pt.
    ``teacher_heads``: the teacher's head count; read from a .ckpt's hyper-parameters if not given.
    """
    teacher, hparams = load_teacher(checkpoint)
    axes = _head_axes(model)
    if teacher_heads is None:
        teacher_heads = hparams.get("num_heads")
    elif isinstance(teacher_heads, bool) or not isinstance(teacher_heads, int) or teacher_heads <= 0:
        raise UserError(f"weight-selection: teacher_heads must be a positive integer, got {teacher_heads!r}")
    if axes and not teacher_heads:
        raise UserError(
            f"weight-selection: {checkpoint} does not record the teacher's num_heads; "
            """pass it with --model.init_args '{"checkpoint": ..., "teacher_heads": N}'"""
        )
    selected = {}
    for key, student in model.state_dict().items():
        name = _strip(key)
        if name not in teacher:
            raise UserError(
                f"weight-selection: the teacher has no tensor '{name}' (it has fewer layers or another "
                "architecture; weight selection needs the same family, at least as deep)"
            )
        selected[key] = select_tensor(name, teacher[name], student, axes.get(key), int(teacher_heads or 1))
        selected[key] = selected[key].to(student.dtype)
    model.load_state_dict(selected)
