"""``python -m lra_cond bench``: time real training steps of :class:`LraModel` at a given shape, or
(``--real-batches``) on the task's prepared data, with what the task's reference run would cost.

One JSON line on stdout. The model and optimizer are the ones training uses (``LraModel`` with the
reference widths, ``LraModel.make_optimizer``); a step is forward + cross-entropy + backward + AdamW
step on a random token batch of exactly ``batch_size x seq_len`` tokens (no padding unless
``--padded``). Timings are wall-clock medians/minima over ``--steps`` steps after ``--warmup`` steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lra_cond.data.documents import document_keys

# Training memory per token of the reference model (dim 64, MLP 128, 2 layers): the activations kept
# for the backward, about 4000 floats a token (measured 1.6-2.0 GB for ListOps' ~33k tokens a step).
BYTES_PER_TOKEN = 16_000


def estimated_bytes(batch: int, seq: int, explicit: bool, heads: int = 2, layers: int = 2) -> int:
    """Rough training memory of one ``bench`` step: linear in the tokens, plus the N x N matrices the
    explicit attention path keeps (scores, probabilities, their gradients) per head and layer."""
    quadratic = 4 * 4 * batch * heads * layers * seq * seq if explicit else 0
    return BYTES_PER_TOKEN * batch * seq + quadratic


def available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def random_batch(
    spec: Any, batch: int, seq: int, padded: bool, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """Random tokens (ids 1..vocab-1) and labels; full lengths unless ``padded``."""
    out: dict[str, torch.Tensor] = {}
    for ids_key, length_key in document_keys(getattr(spec, "pair", False)):
        ids = torch.randint(1, spec.vocab_size, (batch, seq), generator=gen)
        if padded:
            lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=gen)
            lengths[0] = seq  # the batch is as long as its longest sequence
        else:
            lengths = torch.full((batch,), seq)
        ids[torch.arange(seq)[None, :] >= lengths[:, None]] = 0
        out[ids_key], out[length_key] = ids, lengths
    out["label"] = torch.randint(0, spec.num_classes, (batch,), generator=gen)
    return out


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> None:
    """What Lightning runs per training step (minus logging): loss, backward, AdamW step."""
    loss = F.cross_entropy(model(batch), batch["label"])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (Linux clear_refs 5); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _proc_status_mb(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class PeakMemory:
    """Peak memory during a block: CUDA max allocated, else RSS high-water mark of this process."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.kind = ""
        self.peak_mb: float | None = None
        self.before_mb: float | None = None

    def __enter__(self) -> PeakMemory:
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            self.before_mb = torch.cuda.memory_allocated() / 2**20
        else:
            self.before_mb = _proc_status_mb("VmRSS")
            self._reset = _reset_peak_rss() and _proc_status_mb("VmHWM") is not None
            self._maxrss_before = _maxrss_mb()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device == "cuda":
            self.kind = "cuda_max_allocated"
            self.peak_mb = torch.cuda.max_memory_allocated() / 2**20
        elif self._reset:
            self.kind = "rss_peak_during_steps"
            self.peak_mb = _proc_status_mb("VmHWM")
        else:  # lifetime peak: exact only if the timed steps set it
            self.kind = "rss_lifetime_peak"
            self.peak_mb = max(_maxrss_mb(), self._maxrss_before)


def _baddbmm_flops(acc_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001
    batch, n, k = a_shape
    return 2 * batch * n * k * b_shape[-1]


def _sdpa_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(q_shape, k_shape, v_shape)


def _sdpa_backward_flops(g_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return sdpa_backward_flop_count(g_shape, q_shape, k_shape, v_shape)


def count_flops(step: Callable[[], None]) -> int:
    """Matmul/attention FLOPs executed by one ``step()`` (FlopCounterMode, plus CPU flash SDPA)."""
    from torch.utils.flop_counter import FlopCounterMode

    aten = torch.ops.aten
    # torch's counter misses the CPU flash kernel (same formulas as the CUDA ones) and the in-place
    # baddbmm_ (used by the blockwise softmax kernel).
    extra = {aten.baddbmm_: _baddbmm_flops}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        extra[aten._scaled_dot_product_flash_attention_for_cpu] = _sdpa_flops
        extra[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _sdpa_backward_flops
    counter = FlopCounterMode(display=False, custom_mapping=extra)
    with counter:
        step()
    return int(counter.get_total_flops())


def loader_rate(args: argparse.Namespace, seconds: float = 3.0, max_batches: int = 300) -> tuple[Any, str]:
    """Training-loader batches/s over the task's prepared data, or (None, reason)."""
    from lra_cond.data import cache
    from lra_cond.data.datamodule import LraDataModule

    data_dir = Path(args.data_dir) if args.data_dir else cache.default_data_dir()
    path = cache.prepared_dir(data_dir, args.task, args.preset)
    if not cache.is_prepared(path):
        return None, f"no prepared {args.task} ({args.preset}) data at {path}"
    kw = {} if args.num_workers is None else {"num_workers": args.num_workers}
    dm = LraDataModule(args.task, str(data_dir), args.preset, batch_size=args.batch_size, **kw)
    dm.setup("fit")
    loader = dm.train_dataloader()
    it = iter(loader)
    next(it)  # worker start-up and first fetch are not throughput
    n, start = 0, time.perf_counter()
    for _ in it:
        n += 1
        if n >= max_batches or time.perf_counter() - start > seconds:
            break
    elapsed = time.perf_counter() - start
    return (round(n / elapsed, 2) if n else None), f"{n} batches from {path}"


def monitor_probe(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[float, int, str]:
    """Time one probe of a default ``ConditionNumberMonitor`` (its probe taken from ``batch`` as in
    ``fit``): (seconds, its cadence, a note)."""
    from lra_cond.callbacks.condition_monitor import ConditionNumberMonitor
    from lra_cond.callbacks.layer_inputs import take_probe_batch

    monitor = ConditionNumberMonitor()
    probe = take_probe_batch([{k: v.cpu() for k, v in batch.items()}], monitor.probe_tokens)
    start = time.perf_counter()
    results = monitor.measure_layers(model, probe)
    probe_s = time.perf_counter() - start
    note = (
        f"probe {probe_s:.1f} s every {monitor.every_n_steps} steps "
        f"({monitor.method}, {monitor.probe_tokens} tokens, {len(results)} layers)"
    )
    unmeasured = [r.reason for r in results if r.reason]
    if unmeasured:
        note += f"; {unmeasured[0]}"
    unexplained = sum(r.n_null - r.n_null_expected for r in results if r.kappa is not None)
    if unexplained:
        note += f"; {unexplained} null value(s) beyond the verified symmetries"
    return probe_s, monitor.every_n_steps, note


def gemm_gflops(n: int = 1536, reps: int = 3, device: str = "cpu") -> float:
    """This process's float64 matrix-product rate (GFLOP/s, best of ``reps`` n x n products after
    one warm-up): the condition probe is mostly such products, and a machine's rate moves by tens
    of percent between machines and within a session, so a probe time reads only next to it."""
    a = torch.randn(n, n, dtype=torch.float64, device=device)
    b = torch.randn(n, n, dtype=torch.float64, device=device)
    a @ b
    _sync(device)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def probe_fraction(probe_s: float | None, every: int, step_s: float) -> float | None:
    """One probe over the training time between two probes: probe_s / (every_n_steps x step_s);
    None when the probe was not timed or the run takes no probes between steps (every <= 0)."""
    return None if probe_s is None or every <= 0 else round(probe_s / (every * step_s), 5)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lra_cond.data.tasks import TASKS
    from lra_cond.models.attention import explicit_math
    from lra_cond.training.module import LraModel

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    spec = TASKS.get(args.task)
    model = LraModel(
        task=args.task,
        attention=args.attention,
        attention_args=args.attention_args,
        max_len=max(args.seq_len, spec.max_len),
    ).to(args.device)
    model.train()
    opt = model.make_optimizer()
    gen = torch.Generator().manual_seed(args.seed)
    batches = [random_batch(spec, args.batch_size, args.seq_len, args.padded, gen) for _ in range(2)]
    batches = [{k: v.to(args.device) for k, v in b.items()} for b in batches]
    # The monitor's probes land at step 0 and every N steps, where the model is either freshly
    # initialised or well trained; time one on the model as fit's step-0 probe sees it.
    probe_s, every, cond_note, gemm = None, 0, "not timed (--no-probe)", None
    if not args.no_probe:
        model.eval()
        gemm = gemm_gflops(device=args.device)  # the machine's pace, just before the probe
        probe_s, every, cond_note = monitor_probe(model, batches[0])
        model.train()
    times: list[float] = []
    cpu_times: list[float] = []  # process CPU seconds: a load-independent view on a shared machine
    with explicit_math(model) if args.explicit else contextlib.nullcontext():
        for i in range(args.warmup):
            train_step(model, opt, batches[i % 2])
        _sync(args.device)
        with PeakMemory(args.device) as mem:
            for i in range(args.steps):
                start, cpu_start = time.perf_counter(), time.process_time()
                train_step(model, opt, batches[i % 2])
                _sync(args.device)
                times.append(time.perf_counter() - start)
                cpu_times.append(time.process_time() - cpu_start)
        flops = count_flops(lambda: train_step(model, opt, batches[0]))
    median = statistics.median(times)
    loader, loader_note = loader_rate(args)
    cond = probe_fraction(probe_s, every, median)
    tokens = args.batch_size * args.seq_len
    return {
        "attention": args.attention,
        "explicit": args.explicit,
        "task": args.task,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "padded": args.padded,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "steps": args.steps,
        "step_s_median": round(median, 5),
        "step_s_min": round(min(times), 5),
        "cpu_s_median": round(statistics.median(cpu_times), 5),
        "tokens_per_s": round(tokens / median, 1),
        "peak_mem_mb": None if mem.peak_mb is None else round(mem.peak_mb, 1),
        "mem_before_steps_mb": None if mem.before_mb is None else round(mem.before_mb, 1),
        "mem_kind": mem.kind,
        "flops_per_step": flops,
        "flops_per_s": round(flops / median, 1),
        "train_steps_per_s": round(1 / median, 4),
        "loader_batches_per_s": loader,
        "loader_note": loader_note,
        "loader_over_train": None if loader is None else round(loader * median, 2),
        "cond_probe_s": None if probe_s is None else round(probe_s, 4),
        "cond_probe_fraction": cond,
        "cond_probe_note": cond_note,
        "probe_gemm_gflops": None if gemm is None else round(gemm, 1),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "loadavg_1min": round(os.getloadavg()[0], 2),
    }


def reference_protocol(task: str, attention: str, attention_args: dict) -> dict[str, Any]:
    """What ``fit --task TASK`` runs: its batch size, steps, validation cadence and probe cadence."""
    from lra_cond.training.compare import resolved_config

    args = ["fit", "--task", task, "--attention", attention]
    if attention_args:
        args += ["--model.attention_args", json.dumps(attention_args)]
    cfg = resolved_config(args)
    steps, every = int(cfg["trainer"]["max_steps"]), int(cfg["cond"]["every_n_steps"])
    return {
        "batch_size": int(cfg["data"]["batch_size"]),
        "max_steps": steps,
        "val_check_interval": int(cfg["trainer"]["val_check_interval"]),
        "cond_every_n_steps": every,
        # at step 0, every ``every`` steps, and at the end
        "probes": 0 if every <= 0 else 1 + steps // every + (1 if steps % every else 0),
    }


def evaluation_pass(model: torch.nn.Module, loader: Any, device: str) -> float:
    """Seconds of one pass over ``loader`` in eval mode without gradients (what a validation costs
    besides Lightning's bookkeeping)."""
    model.eval()
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in loader:
            model({k: v.to(device) for k, v in batch.items()})
    _sync(device)
    model.train()
    return time.perf_counter() - start


def run_on_data(args: argparse.Namespace) -> dict[str, Any]:
    """``bench --real-batches``: training steps on the task's prepared training batches (real lengths,
    in the seeded order fit uses), one validation pass, one probe, and the projected wall time of
    the task's reference run: steps x step + validations x pass + a test pass + probes x probe."""
    from lra_cond.data import cache
    from lra_cond.data.datamodule import LraDataModule
    from lra_cond.training.module import LraModel

    if args.threads:
        torch.set_num_threads(args.threads)
    protocol = reference_protocol(args.task, args.attention, args.attention_args)
    batch_size = args.batch_size or protocol["batch_size"]
    data_dir = Path(args.data_dir) if args.data_dir else cache.default_data_dir()
    dm = LraDataModule(args.task, str(data_dir), args.preset, batch_size=batch_size, seed=args.seed)
    dm.prepare_data()
    dm.setup("fit")
    torch.manual_seed(args.seed)
    model = LraModel(task=args.task, attention=args.attention, attention_args=args.attention_args).to(
        args.device
    )
    opt = model.make_optimizer()
    loader = iter(dm.train_dataloader())
    batches = [
        {k: v.to(args.device) for k, v in next(loader).items()} for _ in range(args.warmup + args.steps)
    ]
    probe_s, cond_note, gemm = None, "not timed (--no-probe)", None
    if not args.no_probe:
        from lra_cond.callbacks.layer_inputs import take_probe_batch

        model.eval()
        gemm = gemm_gflops(device=args.device)
        probe_batch = take_probe_batch(dm.probe_dataloader(), 256)
        probe_s, _, cond_note = monitor_probe(model, probe_batch)
    model.train()
    times: list[float] = []
    tokens: list[int] = []
    with PeakMemory(args.device) as mem:
        for i, batch in enumerate(batches):
            start = time.perf_counter()
            train_step(model, opt, batch)
            _sync(args.device)
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
                tokens.append(sum(int(v.sum()) for k, v in batch.items() if k.startswith("length")))
        val_s = evaluation_pass(model, dm.val_dataloader(), args.device)
    step = statistics.median(times)
    loader, loader_note = loader_rate(argparse.Namespace(**{**vars(args), "batch_size": batch_size}))
    n_val, n_test = len(dm.splits["val"]), len(dm.splits["test"])
    validations = protocol["max_steps"] // protocol["val_check_interval"]
    parts = {
        "steps": protocol["max_steps"] * step,
        "validations": validations * val_s,
        "test": val_s * n_test / max(1, n_val),
        "probes": protocol["probes"] * (probe_s or 0.0),
    }
    return {
        "attention": args.attention,
        "task": args.task,
        "preset": args.preset,
        "batch_size": batch_size,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "steps": args.steps,
        "step_s_median": round(step, 5),
        "step_s_min": round(min(times), 5),
        "real_tokens_per_step": round(statistics.mean(tokens), 1),
        "val_pass_s": round(val_s, 3),
        "val_examples": n_val,
        "cond_probe_s": None if probe_s is None else round(probe_s, 4),
        "cond_probe_fraction": probe_fraction(probe_s, protocol["cond_every_n_steps"], step),
        "cond_probe_note": cond_note,
        "probe_gemm_gflops": None if gemm is None else round(gemm, 1),
        "peak_mem_mb": None if mem.peak_mb is None else round(mem.peak_mb, 1),
        "mem_kind": mem.kind,
        "loader_batches_per_s": loader,
        "loader_note": loader_note,
        "reference_run": {**protocol, "validations": validations},
        "projected_run_s": {k: round(v, 1) for k, v in parts.items()}
        | {"total": round(sum(parts.values()), 1)},
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "loadavg_1min": round(os.getloadavg()[0], 2),
    }
