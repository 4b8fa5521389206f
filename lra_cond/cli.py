"""The command line, ``python -m lra_cond COMMAND ...``: every command's parser and help, each
calling the module that does the work.

- ``fit``/``validate``/``test``: the LightningCLI subclass (``lra_cond.training.lightning_cli``), with
  fit's shortcuts (``--task``, ``--attention``, ``--init``: ``lra_cond.training.arguments``);
- ``prepare``: ``TaskSpec.prepare`` (``lra_cond.data.tasks``);
- ``bench``: ``lra_cond.training.bench``;
- ``compare``: the sweep orchestrator ``lra_cond.training.compare``;
- ``report``: ``lra_cond.report.build``.
"""

from __future__ import annotations

import gc
import json
import os
import shlex
import sys
from pathlib import Path

from lra_cond.errors import Interrupted, OneLineParser, UserError, user_path
from lra_cond.heap import no_kernel_cache
from lra_cond.help_text import help_row, parse_error_message, prog
from lra_cond.quiet import quiet_third_party
from lra_cond.training.arguments import expand_shortcuts, pop_option

TRAINER_COMMANDS = ("fit", "validate", "test")
COMMANDS = (*TRAINER_COMMANDS, "prepare", "bench", "compare", "report")
# One line per command in the top-level help.
COMMAND_HELP = {
    "fit": "train one run into its run folder, then test its best checkpoint",
    "validate": "evaluate a checkpoint on the validation split (--ckpt_path FILE or last); writes nothing",
    "test": "evaluate a checkpoint on the test split (--ckpt_path FILE or last); writes nothing",
    "prepare": "build a task's prepared data cache",
    "compare": "fit several inits x seeds (reusing finished runs), then write a report",
    "report": "rebuild the comparison report from existing run folders: report RUNS_DIR",
    "bench": "time training steps at a shape (one JSON line)",
}


def top_help() -> str:
    from lra_cond.data import cache
    from lra_cond.data.tasks import TASKS
    from lra_cond.init import INITS
    from lra_cond.models.attention import ATTENTIONS

    me = prog()
    lines = [
        f"usage: {me} COMMAND [options]",
        "",
        "Long Range Arena benchmark suite for studying attention-weight initialization.",
        "",
        "commands:",
        *[help_row(name, text, 10) for name, text in COMMAND_HELP.items()],
        "",
        "shortcuts of fit, validate and test (and compare's --task, --attention):",
        help_row(
            "--task TASK",
            f"one of: {', '.join(TASKS.names())} (loads configs/defaults.yaml and configs/TASK.yaml first)",
        ),
        help_row("--attention NAME", f"one of: {', '.join(ATTENTIONS.names())} (default softmax)"),
        help_row("--init NAME", f"one of: {', '.join(INITS.names())} (default default)"),
        "",
        "where things go:",
        help_row("data", f"$LRA_DATA, else ~/.cache/lra_cond (here: {cache.default_data_dir()})", 10),
        help_row(
            "runs",
            "RUN_ROOT/<task>[-<preset>][-<run_name>]/<attention>/<init>/seed<k>/ (RUN_ROOT: "
            "--run_root, default runs)",
            10,
        ),
        "",
        "examples:",
        f"  {me} fit --task listops --init conditioned",
        f"  {me} fit --task listops --data.preset tiny --trainer.max_steps 100   # a smoke run",
        f"  {me} COMMAND --help",
    ]
    return "\n".join(lines)


def prepare_command(argv: list[str]) -> None:
    from lra_cond.data import cache
    from lra_cond.data.tasks import TASKS

    p = OneLineParser(
        prog=f"{prog()} prepare",
        description="Build a task's prepared data cache.",
    )
    p.add_argument("--task", required=True, help=f"one of: {', '.join(TASKS.names())}")
    p.add_argument("--preset", default="full", help="full (the LRA splits) or tiny (smoke-test size)")
    p.add_argument(
        "--data-dir",
        type=user_path,
        default=None,
        help="data root (default: $LRA_DATA, else ~/.cache/lra_cond)",
    )
    p.add_argument(
        "--source",
        type=user_path,
        default=None,
        help="downloaded data to read (official release folder or a local export); without it, synthetic "
        "tasks are generated, tiny presets use a fixture, and hub datasets are fetched",
    )
    p.add_argument("--seed", type=int, default=0, help="generator seed (synthetic tasks)")
    p.add_argument("--workers", type=int, default=None, help="generator processes (default: all cores)")
    args = p.parse_args(argv)
    spec = TASKS.get(args.task)
    data_dir = Path(args.data_dir) if args.data_dir else cache.default_data_dir()
    out = spec.prepare(data_dir, args.preset, source=args.source, seed=args.seed, workers=args.workers)
    print(f"prepared {args.task} ({args.preset}) at {out}")


ATTENTION_ARGS_EXAMPLE = '{"num_landmarks": 64}'


def bench_command(argv: list[str]) -> None:
    from lra_cond.data.tasks import TASKS
    from lra_cond.models.attention import ATTENTIONS
    from lra_cond.training import bench

    p = OneLineParser(
        prog=f"{prog()} bench",
        description="Time real training steps (forward, loss, backward, AdamW step) of the training model at "
        "a given shape, on random token batches, and print one JSON line: step times, tokens/s, peak memory, "
        "FLOPs, the task's data-loader rate and one condition-number probe.",
    )
    p.add_argument("--attention", required=True, help=f"one of: {', '.join(ATTENTIONS.names())}")
    p.add_argument(
        "--real-batches",
        action="store_true",
        help="train on the task's prepared batches (real lengths, fit's order), time one validation pass, "
        "and project the wall time of the task's reference run (steps, validations, test, probes)",
    )
    p.add_argument(
        "--seq-len", type=int, default=None, help="tokens per sequence (required without --real-batches)"
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="sequences per batch (with --real-batches: the task config's)",
    )
    p.add_argument("--task", default="listops", help=f"vocabulary/classes of: {', '.join(TASKS.names())}")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where to train")
    p.add_argument("--explicit", action="store_true", help="use the explicit-math attention path")
    p.add_argument("--padded", action="store_true", help="random lengths in [seq/2, seq] (padding)")
    p.add_argument("--attention-args", default="{}", help="JSON dict, e.g. '{\"num_landmarks\": 64}'")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--data-dir", type=user_path, default=None, help="prepared data root for the loader rate")
    p.add_argument("--preset", default="full", help="data preset for the loader rate")
    p.add_argument("--num-workers", type=int, default=None, help="loader workers (default: the DataModule's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the random batches")
    p.add_argument("--no-probe", action="store_true", help="skip timing the condition-number probe")
    args = p.parse_args(argv)
    ATTENTIONS.get(args.attention)
    TASKS.get(args.task)
    if not args.real_batches:
        for name in ("seq_len", "batch_size"):
            if getattr(args, name) is None:
                raise UserError(
                    f"--{name.replace('_', '-')} is required (or --real-batches to use the task's data)"
                )
    for name in ("seq_len", "batch_size", "steps"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.warmup < 0:
        raise UserError(f"--warmup must be >= 0, got {args.warmup}")
    try:
        args.attention_args = json.loads(args.attention_args)
    except json.JSONDecodeError as e:
        example = ATTENTION_ARGS_EXAMPLE
        raise UserError(f"--attention-args is not valid JSON ({e}); example: '{example}'") from None
    if not isinstance(args.attention_args, dict):
        raise UserError(f"--attention-args must be a JSON object, e.g. '{ATTENTION_ARGS_EXAMPLE}'")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available; use --device cpu")
    if not args.real_batches and args.device == "cpu":
        need = bench.estimated_bytes(args.batch_size, args.seq_len, args.explicit)
        free = bench.available_bytes()
        if free is not None and need > free:
            raise UserError(
                f"bench: {args.batch_size} x {args.seq_len} tokens need about {need / 2**30:.1f} GB to "
                f"train, {free / 2**30:.1f} GB are available; lower --batch-size or --seq-len"
            )
    print(json.dumps(bench.run_on_data(args) if args.real_batches else bench.run(args)), flush=True)


def _names(text: str, what: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise UserError(f"--{what} needs a comma-separated list, got '{text}'")
    return list(dict.fromkeys(names))


def _seeds(text: str) -> list[int]:
    try:
        return [int(s) for s in _names(text, "seeds")]
    except ValueError:
        raise UserError(f"--seeds must be integers separated by commas, got '{text}'") from None


def compare_command(argv: list[str]) -> None:
    from lra_cond.data.tasks import TASKS
    from lra_cond.models.attention import ATTENTIONS
    from lra_cond.training.compare import compare, study_args

    # A study config first, so that the options given on the command line override it.
    pre = OneLineParser(prog=f"{prog()} compare", add_help=False, allow_abbrev=False)
    pre.add_argument("--config", type=user_path, action="append", default=[])
    known, argv = pre.parse_known_args(argv)
    if len(known.config) > 1:
        raise UserError("compare takes one --config study file")
    argv = [*(study_args(known.config[0]) if known.config else []), *argv]

    p = OneLineParser(
        prog=f"{prog()} compare",
        usage="%(prog)s [--config STUDY.yaml] --task TASK [options] [fit options]",
        description="Fit each init x seed (reusing finished runs, resuming interrupted ones), then write "
        "RUN_ROOT/<task>[-<preset>][-<run_name>]/<attention>/compare/report.md. Other arguments are passed "
        "to every fit. --config STUDY.yaml reads these options (task, attention, inits, seeds, run_root, "
        "run_name) and 'fit:' "
        "options for every fit from a file, e.g. configs/study-listops-cpu.yaml; the command line "
        "overrides it. (A fit config file goes in the study file as 'fit: {config: FILE}'.)",
        allow_abbrev=False,
    )
    p.add_argument("--task", required=True, help=f"one of: {', '.join(TASKS.names())}")
    p.add_argument("--attention", default="softmax", help=f"one of: {', '.join(ATTENTIONS.names())}")
    p.add_argument("--inits", default="default,conditioned", help="comma-separated init schemes")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument(
        "--run_root",
        type=user_path,
        default="runs",
        help="runs go to RUN_ROOT/<task>[-<preset>][-<run_name>]/<attention>/<init>/seed<k> (the preset "
        "when it is not full)",
    )
    p.add_argument("--run_name", default=None, help="a name for this variant of the study (e.g. lr3e-4)")
    p.add_argument("--plan", action="store_true", help="print one fit command per line; run nothing")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="fits run side by side, each logging to <runs>/compare/logs/<init>-seed<k>.log, with one "
        "progress line per running fit",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="intra-op threads per fit (default: torch's, or cores // jobs)",
    )
    args, overrides = p.parse_known_args(argv)
    inits = _names(args.inits, "inits")
    seeds = _seeds(args.seeds)
    cores = os.cpu_count() or 1
    if not 1 <= args.jobs <= cores:
        raise UserError(f"--jobs must be in 1..{cores} (this machine's cores), got {args.jobs}")
    if args.threads is not None and not 1 <= args.threads <= cores:
        raise UserError(f"--threads must be in 1..{cores} (this machine's cores), got {args.threads}")
    compare(
        args.task, args.attention, inits, seeds, overrides, args.run_root, args.run_name,
        plan=args.plan, jobs=args.jobs, threads=args.threads,
    )  # fmt: skip


def report_command(argv: list[str]) -> None:
    from lra_cond.report.build import rebuild_report

    p = OneLineParser(
        prog=f"{prog()} report",
        description="Rebuild the init-comparison report from run folders RUNS_DIR/<init>/seed<k>/.",
    )
    p.add_argument("runs_dir", type=user_path, help="e.g. runs/listops/softmax")
    args = p.parse_args(argv)
    print(f"report written to {rebuild_report(Path(args.runs_dir))}")


def trainer_help(argv: list[str]) -> str:
    """The short help of ``fit``/``validate``/``test``: the options a researcher sets, each with the
    value this command line gives it (configs, then flags), and this command's run folder."""
    from lra_cond.data import cache
    from lra_cond.data.tasks import TASKS
    from lra_cond.init import INITS
    from lra_cond.models.attention import ATTENTIONS
    from lra_cond.training.lightning_cli import LraCLI, parse_only

    command, me = argv[0], prog()
    cli = parse_only([command, *(a for a in argv[1:] if a not in ("-h", "--help"))])
    cfg = cli.config
    fit = command == "fit"

    def value(v: object) -> str:
        return "[none]" if v is None else f"[{json.dumps(v) if isinstance(v, (dict, list)) else v}]"

    rows = [
        (
            "--task TASK",
            f"one of: {', '.join(TASKS.names())}; loads configs/defaults.yaml and "
            f"configs/TASK.yaml before the other options {value(cfg.data.task)}",
        ),
        ("--attention NAME", f"one of: {', '.join(ATTENTIONS.names())} {value(cfg.model.attention)}"),
        ("--init NAME", f"one of: {', '.join(INITS.names())} {value(cfg.model.init)}"),
        (
            "--model.attention_args JSON",
            "the family's options, e.g. '{\"num_landmarks\": 32}' " + value(cfg.model.attention_args or {}),
        ),
        (
            "--model.init_args JSON",
            "the scheme's parameters, e.g. '{\"v_scale\": 2.0}' " + value(cfg.model.init_args or {}),
        ),
        (
            "--data.preset NAME",
            f"one of: {', '.join(TASKS.get(cfg.data.task).presets)} (tiny: a smoke "
            f"test) {value(cfg.data.preset)}",
        ),
        (
            "--data.data_dir DIR",
            "prepared data; default $LRA_DATA, else ~/.cache/lra_cond "
            + value(cfg.data.data_dir or str(cache.default_data_dir())),
        ),
        ("--data.batch_size N", f"examples per batch {value(cfg.data.batch_size)}"),
    ]
    if fit:
        rows += [
            ("--trainer.max_steps N", f"optimizer steps to train {value(cfg.trainer.max_steps)}"),
            (
                "--trainer.val_check_interval N",
                f"steps between validations {value(cfg.trainer.val_check_interval)}",
            ),
            ("--model.lr LR", f"peak learning rate {value(cfg.model.lr)}"),
            ("--model.warmup_steps N", f"steps of the rising lr {value(cfg.model.warmup_steps)}"),
            (
                "--cond.every_n_steps N",
                "measure the attention Jacobian's condition number at step 0, every N "
                f"steps and at the end; 0 switches the monitor off (faster) {value(cfg.cond.every_n_steps)}",
            ),
            ("--cond.probe_tokens N", f"tokens of the probe batch {value(cfg.cond.probe_tokens)}"),
        ]
    rows += [
        ("--seed_everything N", f"the seed; the run folder is seed<N> {value(cfg.seed_everything)}"),
        ("--run_root DIR", f"where run folders go {value(cfg.run_root)}"),
        (
            "--run_name NAME",
            f"a name for a variant of the study, added to the task's folder {value(cfg.run_name)}",
        ),
        (
            "--ckpt_path last",
            "resume this run folder's interrupted run"
            if fit
            else "the checkpoint to evaluate: a .ckpt file, or last (this run folder's last.ckpt)",
        ),
        (
            "--trainer.accelerator A",
            "cpu, gpu or auto; one GPU: --trainer.accelerator gpu --trainer.devices 1 "
            f"{value(cfg.trainer.accelerator)}",
        ),
        ("--config FILE", "a YAML file of these options; --print_config prints the resolved one"),
    ]
    what = {
        "fit": "Train one run into its run folder, then test its best checkpoint (by validation accuracy).",
        "validate": "Evaluate a checkpoint on the validation split; print the results, write nothing.",
        "test": "Evaluate a checkpoint on the test split; print the results, write nothing.",
    }[command]
    lines = [
        f"usage: {me} {command} --task TASK [--attention NAME] [--init NAME] [options]",
        "",
        what,
        "",
        "options ([value] = what this command line sets: configs/defaults.yaml and configs/TASK.yaml, "
        "then your flags):",
        *[help_row(name, text, 30) for name, text in rows],
        "",
        f"run folder of this command: {LraCLI.run_path(cfg)}",
        f"all options (Lightning's trainer, model, data, callbacks): {me} {command} --help-all",
    ]
    return "\n".join(lines)


def run_lightning(argv: list[str]) -> None:
    from jsonargparse import ArgumentError
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lra_cond.training.lightning_cli import LraCLI

    # Parsed from a list, sys.argv left as it is: under DDP, Lightning starts the other ranks with
    # this process's command line (``python -m lra_cond`` + sys.argv[1:]), and each expands the same
    # shortcuts into the same options.
    command, *options = expand_shortcuts(argv)
    try:
        LraCLI(command, args=options, prog=f"{prog()} {command}").run()
    except Interrupted as e:
        if not e.resumable:
            raise
        again = [*argv]
        pop_option(again, "--ckpt_path")
        raise Interrupted(
            f"{e}; continue with: {prog()} {shlex.join([*again, '--ckpt_path', 'last'])}", status=e.status
        ) from None
    except ArgumentError as e:
        raise UserError(parse_error_message(e, argv[0])) from None
    except MisconfigurationException as e:  # Lightning's own "bad option" errors
        raise UserError(" ".join(str(e).split())) from None


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    no_kernel_cache()
    quiet_third_party()
    try:
        if not argv or argv[0] in ("-h", "--help"):
            print(top_help())
            return
        if argv[0] == "prepare":
            prepare_command(argv[1:])
        elif argv[0] == "bench":
            bench_command(argv[1:])
        elif argv[0] == "compare":
            compare_command(argv[1:])
        elif argv[0] == "report":
            report_command(argv[1:])
        elif argv[0] in TRAINER_COMMANDS:
            if any(a in ("-h", "--help") for a in argv[1:]):
                print(trainer_help(argv))
                return
            # Lightning's full option list: jsonargparse's --help.
            run_lightning([a if a != "--help-all" else "--help" for a in argv])
        else:
            raise UserError(f"unknown command '{argv[0]}'; valid commands: {', '.join(COMMANDS)}")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except Interrupted as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.status)
    except KeyboardInterrupt as e:  # outside training (which raises Interrupted): data generation, ...
        print(f"error: interrupted (Ctrl-C){f' {e}' if str(e) else ''}", file=sys.stderr)
        sys.exit(Interrupted.EXIT_STATUS)
    except OSError as e:
        print(f"error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        sys.exit(2)


def console_main() -> None:
    """``python -m lra_cond`` and the ``lra-cond`` script: ``main`` with a quicker start and exit.
    The imports behind training (torch, Lightning, torch._dynamo) make ~10^6 long-lived objects,
    which every full garbage collection walks again: during the imports themselves (~1 s), and in
    the interpreter's shutdown (~2.8 s after every ``fit``; both measured). So a training command
    imports them with the collector off and freezes them (they live until exit anyway), and every
    command ends frozen: what it wrote is closed by then (loggers, checkpoints, metrics.json), and
    objects are still freed by their reference counts as modules are cleared. Not in ``main``:
    in-process callers (the tests) keep their collector."""
    if sys.argv[1:2] and sys.argv[1] in (*TRAINER_COMMANDS, "bench"):
        gc.disable()
        try:
            import lra_cond.training.lightning_cli  # noqa: F401
        finally:
            gc.freeze()
            gc.enable()
    try:
        main()
    finally:
        gc.freeze()
