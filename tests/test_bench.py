"""``python -m lra_cond bench``: one JSON line with consistent numbers (timings are never asserted)."""

from __future__ import annotations

import json

import pytest
import torch

from lra_cond import bench
from tests.conftest import assert_one_line_error, run_cli

KEYS = {
    "step_s_median",
    "step_s_min",
    "tokens_per_s",
    "peak_mem_mb",
    "flops_per_step",
    "flops_per_s",
    "train_steps_per_s",
    "loader_batches_per_s",
    "loader_over_train",
    "cond_probe_fraction",
    "cond_probe_note",
}
B, N, D, M, H, LAYERS, CLASSES = 2, 64, 64, 128, 2, 2, 10


def forward_matmul_flops() -> int:
    """Forward matmul FLOPs of the reference model at (B, N), counted by hand."""
    per_layer = B * N * (4 * 2 * D * D + 2 * 2 * D * M)  # q, k, v, out projections; MLP
    per_layer += 2 * (2 * B * H * N * N * (D // H))  # Q K^T and P V
    head = 2 * B * (D * M + M * CLASSES)
    return LAYERS * per_layer + head


@pytest.fixture(scope="module")
def results(tiny_listops, tmp_path_factory):
    out = {}
    cwd = tmp_path_factory.mktemp("bench")
    for name, extra in (("fast", []), ("explicit", ["--explicit"])):
        args = ["bench", "--attention", "softmax", "--seq-len", str(N), "--batch-size", str(B)]
        args += ["--steps", "2", "--warmup", "1", "--data-dir", str(tiny_listops), "--preset", "tiny", *extra]
        proc = run_cli(args, cwd)
        assert proc.returncode == 0, proc.stderr[-2000:]
        lines = proc.stdout.strip().splitlines()
        assert len(lines) == 1, proc.stdout
        out[name] = json.loads(lines[0])
    return out


@pytest.mark.parametrize("path", ["fast", "explicit"])
def test_json_line_is_consistent(results, path):
    r = results[path]
    assert KEYS <= set(r)
    assert r["explicit"] == (path == "explicit")
    assert 0 < r["step_s_min"] <= r["step_s_median"]
    assert r["tokens_per_s"] == pytest.approx(B * N / r["step_s_median"], rel=1e-3)
    assert r["train_steps_per_s"] == pytest.approx(1 / r["step_s_median"], rel=1e-3)
    assert r["flops_per_s"] == pytest.approx(r["flops_per_step"] / r["step_s_median"], rel=1e-3)
    assert r["peak_mem_mb"] > 0 and r["mem_kind"].startswith("rss")
    # Loader rate measured on the prepared tiny split, compared with the training step rate.
    assert r["loader_batches_per_s"] > 0
    assert r["loader_over_train"] == pytest.approx(r["loader_batches_per_s"] * r["step_s_median"], rel=1e-2)


def test_flops_match_hand_count(results):
    # Plain formula: backward = 2 x forward for every matmul (input and weight gradients).
    assert results["explicit"]["flops_per_step"] == 3 * forward_matmul_flops()
    # The blockwise kernel recomputes Q K^T in its backward: one more attention matmul per layer.
    recompute = LAYERS * 2 * B * H * N * N * (D // H)
    assert results["fast"]["flops_per_step"] == 3 * forward_matmul_flops() + recompute


def test_unknown_attention_is_one_line_error(tmp_path):
    proc = run_cli(["bench", "--attention", "nope", "--seq-len", "8", "--batch-size", "1"], tmp_path)
    assert_one_line_error(proc, "unknown attention 'nope'")
    assert "softmax" in proc.stderr  # the valid names are listed


def test_monitor_cost_uses_probe_and_cadence(monkeypatch):
    calls = []

    class FakeMonitor:
        every_n_steps = 50

        def probe(self, model, batch):  # noqa: ANN001, ANN201
            calls.append((model, batch))

    import lra_cond.callbacks as callbacks

    model, batch = torch.nn.Linear(2, 2), {"input_ids": torch.zeros(1, 3)}
    monkeypatch.delattr(callbacks, "ConditionNumberMonitor", raising=False)
    assert bench.monitor_cost(model, batch, 0.5) == (None, "condition monitor not available")
    monkeypatch.setattr(callbacks, "ConditionNumberMonitor", FakeMonitor, raising=False)
    fraction, note = bench.monitor_cost(model, batch, 0.5)
    assert calls == [(model, batch)]
    assert fraction >= 0 and "every 50 steps" in note
    FakeMonitor.every_n_steps = 0  # a monitor that is off costs nothing and is not probed
    assert bench.monitor_cost(model, batch, 0.5)[0] == 0.0
    assert calls == [(model, batch)]
