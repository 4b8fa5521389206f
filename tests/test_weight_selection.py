"""weight-selection: student tensors are exactly the teacher's uniformly selected, head-aligned slices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lra_cond.errors import UserError
from lra_cond.init import apply_init
from lra_cond.models.encoder import Classifier, EncoderConfig, PairClassifier


def classifier(dim: int, heads: int, head_dim: int, depth: int, mlp: int, max_len: int = 24) -> Classifier:
    cfg = EncoderConfig(
        vocab_size=16, max_len=max_len, num_classes=4, dim=dim, depth=depth, num_heads=heads, mlp_dim=mlp
    )
    cfg.head_dim = head_dim
    torch.manual_seed(dim + heads + depth)
    return Classifier(cfg)


def uniform(t: int, s: int) -> list[int]:
    """Reference rule, written out: stride T//S when S divides T, else rounded even spacing."""
    if t % s == 0:
        return [i * (t // s) for i in range(s)]
    return [round(i * (t - 1) / (s - 1)) for i in range(s)]


def heads_rows(h_t: int, d_t: int, h_s: int, d_s: int) -> list[int]:
    return [h * d_t + j for h in uniform(h_t, h_s) for j in uniform(d_t, d_s)]


def expected_slice(key: str, t: torch.Tensor, s_shape: torch.Size, teacher_heads: int, student_heads: int):
    """Index the teacher with plain Python lists, axis by axis (independent of the implementation)."""
    out = t
    for axis, s in enumerate(s_shape):
        size = t.shape[axis]
        is_head_axis = (axis == 0 and any(p in key for p in ("q_proj", "k_proj", "v_proj"))) or (
            axis == 1 and "out_proj.weight" in key
        )
        if is_head_axis:
            idx = heads_rows(teacher_heads, size // teacher_heads, student_heads, s // student_heads)
        else:
            idx = uniform(size, s)
        out = out[(slice(None),) * axis + (idx,)]
    return out


# teacher: width 48, 4 heads of 12, MLP 96, 3 layers, 40 positions; student: width 32 (48 -> 32 does
# not divide: rounded spacing), 2 heads of 6, MLP 32 (96 -> 32: stride 3), 2 layers, 24 positions
TEACHER = {"dim": 48, "heads": 4, "head_dim": 12, "depth": 3, "mlp": 96, "max_len": 40}
STUDENT = {"dim": 32, "heads": 2, "head_dim": 6, "depth": 2, "mlp": 32}


@pytest.fixture
def teacher(tmp_path: Path) -> tuple[Classifier, Path]:
    model = classifier(**TEACHER)
    path = tmp_path / "teacher.pt"
    torch.save(model.state_dict(), path)
    return model, path


def test_student_equals_teacher_slices(teacher: tuple[Classifier, Path]) -> None:
    t_model, path = teacher
    student = classifier(**STUDENT)
    apply_init(student, "weight-selection", checkpoint=str(path), teacher_heads=4)
    t_sd = t_model.state_dict()
    s_sd = student.state_dict()
    for key, value in s_sd.items():
        assert torch.equal(value, expected_slice(key, t_sd[key], value.shape, 4, 2)), key
    # spot checks, by hand: student head 1 = teacher head 2 (uniform(4, 2) = [0, 2]), dims 0, 2, ..., 10
    q_t = t_sd["encoder.blocks.1.attn.q_proj.weight"]
    q_s = s_sd["encoder.blocks.1.attn.q_proj.weight"]
    cols = uniform(48, 32)
    assert cols[:4] == [0, 2, 3, 5]
    assert torch.equal(q_s[6 + 1, 3], q_t[2 * 12 + 2, cols[3]])
    o_t = t_sd["encoder.blocks.0.attn.out_proj.weight"]
    assert torch.equal(s_sd["encoder.blocks.0.attn.out_proj.weight"][5, 6], o_t[cols[5], 24])


def test_equal_sizes_copy_the_teacher(tmp_path: Path) -> None:
    t_model = classifier(**STUDENT)
    path = tmp_path / "same.pt"
    torch.save({f"net.{k}": v for k, v in t_model.state_dict().items()}, path)  # LraModel-style keys
    student = classifier(**{**STUDENT, "depth": 1})
    apply_init(student, "weight-selection", checkpoint=str(path), teacher_heads=2)
    t_model.encoder.blocks = t_model.encoder.blocks[:1]  # the first layer only
    t_model.eval(), student.eval()
    ids, lengths = torch.randint(1, 16, (3, 10)), torch.tensor([10, 7, 3])
    assert torch.equal(student(ids, lengths), t_model(ids, lengths))


def test_lightning_checkpoint_format_reads_heads_from_hparams(tmp_path: Path) -> None:
    t_model = classifier(**TEACHER)
    path = tmp_path / "teacher.ckpt"
    state = {f"net.{k}": v for k, v in t_model.state_dict().items()}
    torch.save({"state_dict": state, "hyper_parameters": {"num_heads": 4}, "epoch": 0}, path)
    student = classifier(**STUDENT)
    apply_init(student, "weight-selection", checkpoint=str(path))
    key = "encoder.blocks.0.attn.v_proj.weight"
    assert torch.equal(
        student.state_dict()[key], expected_slice(key, t_model.state_dict()[key], (12, 32), 4, 2)
    )


def one_line(fn, *args, **kw) -> str:  # noqa: ANN001
    with pytest.raises(UserError) as info:
        fn(*args, **kw)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_teacher_smaller_names_tensor_and_shapes(teacher: tuple[Classifier, Path]) -> None:
    _, path = teacher
    wide = classifier(**{**STUDENT, "dim": 64, "head_dim": 32})
    msg = one_line(apply_init, wide, "weight-selection", checkpoint=str(path), teacher_heads=4)
    assert "encoder.token_emb.weight" in msg and "(16, 48)" in msg and "(16, 64)" in msg
    many_heads = classifier(**{**STUDENT, "heads": 8, "head_dim": 4})  # 32 rows, but 8 > 4 heads
    msg = one_line(apply_init, many_heads, "weight-selection", checkpoint=str(path), teacher_heads=4)
    assert "q_proj.weight" in msg and "(48, 48)" in msg and "(32, 32)" in msg and "8 heads" in msg
    deep = classifier(**{**STUDENT, "depth": 4})
    msg = one_line(apply_init, deep, "weight-selection", checkpoint=str(path), teacher_heads=4)
    assert "encoder.blocks.3." in msg


def test_checkpoint_errors(teacher: tuple[Classifier, Path], tmp_path: Path) -> None:
    _, path = teacher
    student = classifier(**STUDENT)
    missing = tmp_path / "nowhere" / "teacher.ckpt"
    assert str(missing) in one_line(apply_init, student, "weight-selection", checkpoint=str(missing))
    assert "teacher_heads" in one_line(apply_init, student, "weight-selection", checkpoint=str(path))
    junk = tmp_path / "junk.ckpt"
    junk.write_text("not a checkpoint")
    assert str(junk) in one_line(apply_init, student, "weight-selection", checkpoint=str(junk))
    msg = one_line(apply_init, student, "weight-selection", checkpoint=str(path), teacher_heads=2.5)
    assert "teacher_heads" in msg and "2.5" in msg


def test_pair_head_selection_stays_block_aligned(tmp_path: Path) -> None:
    """The retrieval head sees [e1, e2, e1*e2, e1-e2] (4*D inputs). With D_s dividing D_t the
    uniform stride on 4*D_t picks, inside every block, the same channels as on the width D_t."""
    cfg = EncoderConfig(vocab_size=16, max_len=24, num_classes=2, dim=32, depth=1, num_heads=2, mlp_dim=32)
    t_model = PairClassifier(cfg)
    path = tmp_path / "pair.pt"
    torch.save(t_model.state_dict(), path)
    student = PairClassifier(EncoderConfig(**{**cfg.__dict__, "dim": 16}))
    apply_init(student, "weight-selection", checkpoint=str(path), teacher_heads=2)
    cols = [b * 32 + c for b in range(4) for c in uniform(32, 16)]
    assert torch.equal(student.head[0].weight, t_model.head[0].weight[:, cols])
