"""``python -m lra_cond bench``: one JSON line with consistent numbers (timings are never asserted)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from lra_cond.training import bench
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
    "cond_probe_s",
    "cond_probe_fraction",
    "cond_probe_note",
    "probe_gemm_gflops",
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
    for name, extra in (("fast", []), ("explicit", ["--explicit", "--no-probe"])):
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
    if path == "fast":  # the default monitor's probe, timed, over its cadence's worth of steps
        from lra_cond.callbacks.condition_monitor import DEFAULT_EVERY_N_STEPS

        assert r["cond_probe_s"] > 0
        expected = r["cond_probe_s"] / (DEFAULT_EVERY_N_STEPS * r["step_s_median"])
        assert r["cond_probe_fraction"] == pytest.approx(expected, rel=0.05, abs=1e-5)  # rounded
        assert r["probe_gemm_gflops"] > 0
    else:  # --no-probe
        assert r["cond_probe_s"] is None and r["cond_probe_fraction"] is None
        assert r["probe_gemm_gflops"] is None
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
    # The blockwise kernel keeps this small shape's probabilities for its backward (within
    # blockwise.SAVED_SCORES): no Q K^T recomputed, the same count. (Beyond that budget it recomputes
    # Q K^T: one more attention matmul per layer.)
    assert results["fast"]["flops_per_step"] == 3 * forward_matmul_flops()


def test_gemm_rate_is_the_best_product_over_its_time(monkeypatch):
    """2 n^3 flops over the fastest of the timed products (a clock that gives each product 0.5 s,
    then one 0.25 s, reads 2 n^3 / 0.25)."""
    ticks = iter([0.0, 0.5, 1.0, 1.25, 2.0, 2.5])  # three timed products: 0.5, 0.25, 0.5 s
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(ticks))
    n = 64
    assert bench.gemm_gflops(n=n, reps=3) == pytest.approx(2 * n**3 / 0.25 / 1e9)


def test_unknown_attention_is_one_line_error(tmp_path):
    proc = run_cli(["bench", "--attention", "nope", "--seq-len", "8", "--batch-size", "1"], tmp_path)
    assert_one_line_error(proc, "unknown attention 'nope'")
    assert "softmax" in proc.stderr  # the valid names are listed


def test_monitor_probe_times_the_default_monitor(monkeypatch):
    """bench times one real probe of a default ConditionNumberMonitor, taken from its batch as fit
    takes it, over the default cadence's worth of steps; a monitor that is off costs nothing."""
    from lra_cond.callbacks.condition_monitor import ConditionNumberMonitor
    from lra_cond.training.module import LraModel

    calls = []
    real_probe = ConditionNumberMonitor.measure_layers

    def spy(self, model, probe):  # noqa: ANN001, ANN202
        start = time.perf_counter()
        results = real_probe(self, model, probe)
        calls.append((self, int(probe["length"].sum()), results, time.perf_counter() - start))
        return results

    monkeypatch.setattr(ConditionNumberMonitor, "measure_layers", spy)
    torch.manual_seed(0)
    model = LraModel(task="listops", dim=16, mlp_dim=32, max_len=300)
    batch = {"input_ids": torch.randint(1, 16, (3, 300)), "length": torch.tensor([200, 80, 300])}
    probe_s, every, note = bench.monitor_probe(model, batch)
    fraction = bench.probe_fraction(probe_s, every, 0.01)
    [(monitor, tokens, results, seconds)] = calls
    assert tokens == 280 and monitor.probe_tokens == 256  # the examples (each cropped) closest to 256
    assert len(results) == 2 and all(r.kappa is not None and r.kappa > 1 for r in results)
    assert fraction == pytest.approx(seconds / (monitor.every_n_steps * 0.01), rel=0.05, abs=1e-5)
    assert f"every {monitor.every_n_steps} steps" in note and "gram" in note
    assert "beyond the verified" not in note  # every null value explained


def test_real_batches_projects_the_reference_run(tiny_listops, tmp_path):
    """``--real-batches``: steps on the prepared split's batches (real lengths), one validation pass,
    and the reference run's cost as the sum of its parts (ListOps: 5000 steps, a validation every 50,
    probes at 0, 1500, 3000, 4500 and 5000)."""
    args = ["bench", "--attention", "softmax", "--real-batches", "--steps", "3", "--warmup", "1"]
    args += ["--data-dir", str(tiny_listops), "--preset", "tiny", "--no-probe"]
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["batch_size"] == 32 and out["steps"] == 3
    assert out["reference_run"] == {
        "batch_size": 32,
        "max_steps": 5000,
        "val_check_interval": 50,
        "cond_every_n_steps": 1500,
        "probes": 5,
        "validations": 100,
    }
    from datasets import load_from_disk

    split = load_from_disk(str(tiny_listops / "listops" / "tiny" / "prepared"))
    assert out["val_examples"] == len(split["val"])
    lengths = split["train"]["length"]
    assert 0 < out["real_tokens_per_step"] <= 32 * max(lengths)  # real tokens, not padded ones
    parts = out["projected_run_s"]
    assert parts["steps"] == pytest.approx(5000 * out["step_s_median"], abs=0.1)
    assert parts["validations"] == pytest.approx(100 * out["val_pass_s"], abs=0.1)
    assert parts["test"] == pytest.approx(out["val_pass_s"] * len(split["test"]) / len(split["val"]), abs=0.1)
    assert parts["probes"] == 0.0 and out["cond_probe_s"] is None  # --no-probe
    assert out["cond_probe_fraction"] is None
    total = parts["steps"] + parts["validations"] + parts["test"] + parts["probes"]
    assert parts["total"] == pytest.approx(total, abs=0.2)
    assert out["loader_batches_per_s"] > 0


def test_real_batches_gives_the_probe_s_share_of_training(tiny_listops, tmp_path):
    """With the probe timed: its share of the training between two probes of the reference run
    (probe / (1500 x step)), and the projected run's five probes."""
    args = ["bench", "--attention", "softmax", "--real-batches", "--steps", "2", "--warmup", "1"]
    args += ["--data-dir", str(tiny_listops), "--preset", "tiny"]
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    probe, step = out["cond_probe_s"], out["step_s_median"]
    assert probe > 0 and out["projected_run_s"]["probes"] == pytest.approx(5 * probe, abs=0.1)
    assert out["cond_probe_fraction"] == pytest.approx(probe / (1500 * step), rel=5e-3)


def test_bench_without_shape_or_real_batches_is_one_line_error(tmp_path):
    proc = run_cli(["bench", "--attention", "softmax", "--batch-size", "2"], tmp_path)
    assert_one_line_error(proc, "--seq-len is required (or --real-batches to use the task's data)")
