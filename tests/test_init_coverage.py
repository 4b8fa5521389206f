"""Every init scheme x every attention family builds, gives finite outputs and trains; the CLI plumbs
scheme parameters into the model and the run's hparams.

Split, to keep CI time low: the full cross-product runs in-process (forward pass + a few AdamW
steps on a fixed batch, loss must drop); the subprocess CLI fits (the expensive part: one Python +
Lightning start each) cover the parameter plumbing with two schemes on softmax: ``conditioned``
with ``init_args``, and ``weight-selection`` whose teacher is that first run's Lightning checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from lra_cond.init import INITS, apply_init
from lra_cond.models.attention import ATTENTIONS
from lra_cond.models.encoder import Classifier, EncoderConfig
from lra_cond.training.module import LraModel
from tests.conftest import TINY_FIT, assert_one_line_error, run_cli


def classifier(attention: str, dim: int = 16, num_heads: int = 2, depth: int = 2) -> Classifier:
    cfg = EncoderConfig(
        vocab_size=16,
        max_len=80,
        num_classes=4,
        dim=dim,
        depth=depth,
        num_heads=num_heads,
        head_dim=8,
        mlp_dim=32,
        dropout=0.0,
        attention=attention,
    )
    return Classifier(cfg)


@pytest.fixture(scope="module")
def teachers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per attention family, a larger same-family teacher state_dict (width 32, 4 heads, 3 layers)."""
    root = tmp_path_factory.mktemp("teachers")
    paths = {}
    for attention in ATTENTIONS.names():
        torch.manual_seed(1)
        paths[attention] = root / f"{attention}.pt"
        torch.save(classifier(attention, dim=32, num_heads=4, depth=3).state_dict(), paths[attention])
    return paths


@pytest.mark.parametrize("attention", ATTENTIONS.names())
@pytest.mark.parametrize("init", INITS.names())
def test_scheme_builds_runs_and_trains(init: str, attention: str, teachers: dict[str, Path]) -> None:
    torch.manual_seed(0)
    model = classifier(attention)
    kwargs = (
        {"checkpoint": str(teachers[attention]), "teacher_heads": 4} if init == "weight-selection" else {}
    )
    apply_init(model, init, **kwargs)
    # 72 tokens: long enough for every family's default options (e.g. 64 Nystrom landmarks)
    ids = torch.randint(1, 16, (8, 72))
    lengths = torch.tensor([72, 67, 40, 9, 72, 5, 50, 3])
    labels = torch.arange(8) % 4
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(6):
        logits = model(ids, lengths)
        assert logits.shape == (8, 4) and torch.isfinite(logits).all()
        loss = F.cross_entropy(logits, labels)
        opt.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses  # it learns the fixed batch


@pytest.fixture(scope="module")
def conditioned_run(tiny_listops: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    cwd = tmp_path_factory.mktemp("cli")
    args = ["fit", "--task", "listops", "--init", "conditioned", "--model.init_args", '{"v_scale": 2.0}']
    res = run_cli([*args, *TINY_FIT], cwd, env={"LRA_DATA": str(tiny_listops)})
    assert res.returncode == 0, res.stderr[-3000:]
    return cwd, cwd / "runs/listops-tiny/softmax/conditioned/seed0"


def test_cli_records_scheme_and_params(conditioned_run: tuple[Path, Path]) -> None:
    _, run = conditioned_run
    hparams = yaml.safe_load((run / "hparams.yaml").read_text())
    assert hparams["init"] == "conditioned" and hparams["init_args"] == {"v_scale": 2.0}
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["total_steps"] == 8 and 0.0 <= metrics["test_acc"] <= 1.0


def test_cli_weight_selection_from_a_run(conditioned_run: tuple[Path, Path], tiny_listops: Path) -> None:
    cwd, run = conditioned_run
    ckpt = run / "checkpoints" / "last.ckpt"
    # in-process first: the real Lightning checkpoint (net.* keys, num_heads from its hparams)
    student = LraModel(init="weight-selection", init_args={"checkpoint": str(ckpt)}, dim=32, mlp_dim=64)
    teacher = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    q_t = teacher["net.encoder.blocks.1.attn.q_proj.weight"]  # 2 heads x 32, width 64
    q_s = student.net.encoder.blocks[1].attn.q_proj.weight.detach()  # 2 heads x 16, width 32
    assert torch.equal(q_s, q_t[[h * 32 + 2 * j for h in range(2) for j in range(16)]][:, ::2])
    init_args = json.dumps({"checkpoint": str(ckpt)})
    args = ["fit", "--task", "listops", "--init", "weight-selection", "--model.init_args", init_args]
    args += ["--model.dim", "32", "--model.mlp_dim", "64", "--run_root", "students"]
    res = run_cli([*args, *TINY_FIT], cwd, env={"LRA_DATA": str(tiny_listops)})
    assert res.returncode == 0, res.stderr[-3000:]
    out = cwd / "students/listops-tiny/softmax/weight-selection/seed0"
    assert yaml.safe_load((out / "hparams.yaml").read_text())["init_args"] == {"checkpoint": str(ckpt)}
    assert json.loads((out / "metrics.json").read_text())["total_steps"] == 8


def test_cli_bad_init_parameter_is_one_line(tmp_path: Path, tiny_listops: Path) -> None:
    args = ["fit", "--task", "listops", "--init", "mimetic", "--model.init_args", '{"alpha": 1.0}']
    res = run_cli([*args, *TINY_FIT], tmp_path, env={"LRA_DATA": str(tiny_listops)})
    assert_one_line_error(res, "init 'mimetic' has no parameter 'alpha'")
    assert "alpha1=0.7" in res.stderr and "vo_sign=-1" in res.stderr
