"""`megascale` command line: train, launch, executor, rehearse, trace, report, evict, prepare, convert, plan,
calibrate.

Every verb takes `--config FILE` and `--section.key=value` overrides (see docs/config.md). A mistake the
user can fix prints one line and exits with status 2 (`--debug` shows the traceback); nothing is written
before the inputs have been checked.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megascale.errors import ConfigError, MegascaleError
from megascale.plan import command as plan_command
from megascale.resilience import executor as executor_module
from megascale.resilience import rehearsal as rehearsal_module

OVERRIDES_HELP = (
    "Any config field as --section.key=value (e.g. --model.dim=512 --optim.name=lamb); "
    "see docs/config.md or --print-config."
)


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="TOML job config (default: the built-in defaults, as in configs/default.toml).",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="Print the resolved config as TOML and exit."
    )
    parser.epilog = OVERRIDES_HELP


def _split_overrides(extra: list[str]) -> list[str]:
    """Accept both `--a.b=v` and `--a.b v`; anything else is an unknown argument."""
    overrides, i = [], 0
    while i < len(extra):
        item = extra[i]
        if not item.startswith("--") or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"unknown argument {item!r}; config fields look like --section.key=value")
        if "=" not in item:
            if i + 1 >= len(extra) or extra[i + 1].startswith("--"):
                raise ConfigError(f"config: {item} needs a value, as {item}=VALUE")
            item, i = f"{item}={extra[i + 1]}", i + 1
        overrides.append(item)
        i += 1
    return overrides


def _load(args: argparse.Namespace, extra: list[str]):
    from megascale.config import load_config, to_toml

    cfg = load_config(args.config, _split_overrides(extra))
    if args.print_config:
        sys.stdout.write(to_toml(cfg))
        raise SystemExit(0)
    return cfg


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    from megascale.launch import launch_local, under_launcher

    cfg = _load(args, extra)
    if args.nproc < 1:
        raise ConfigError(f"--nproc = {args.nproc} must be >= 1 (the number of local processes)")
    if args.nproc > 1 and not under_launcher():
        from megascale.parallel.dims import ParallelDims

        ParallelDims.from_config(cfg, world_size=args.nproc)  # a bad layout fails here, before any worker
        worker_args = [*(["--debug"] if args.debug else []), "train", *_config_argv(args), *extra]
        return launch_local(args.nproc, worker_args)

    from megascale.parallel.distributed import close_distributed
    from megascale.trainer import Trainer

    trainer = Trainer(cfg, debug=args.debug)
    summary = trainer.train()
    close_distributed()
    if trainer.rank != 0:
        return 0
    val = f", val loss {summary['val_loss']:.4f}" if "val_loss" in summary else ""
    if summary["interrupted"]:
        state = "stopped by signal"
    elif summary["steps_run"] == 0:
        state = "nothing to train (see the warning above)"
    elif summary["step"] < cfg.training.steps:
        state = "stopped at training.stop_at_step"
    else:
        state = "done"
    trainer.console.print(
        f"{state}: step {summary['step']}/{cfg.training.steps}{val}, "
        f"{summary['wall_s']:.0f} s; run directory {trainer.run_dir}"
    )
    return 0


def cmd_launch(args: argparse.Namespace, extra: list[str]) -> int:
    from megascale.launch import outcome
    from megascale.observe.progress import make_console, setup_logging
    from megascale.parallel.dims import ParallelDims
    from megascale.resilience.driver import Driver
    from megascale.resilience.inject import INJECT, check_spec
    from megascale.trainer import prepare_run_dir

    cfg = _load(args, extra)
    res = cfg.resilience
    ParallelDims.from_config(cfg, world_size=res.nodes * res.nproc_per_node)  # a bad layout fails here
    if res.executors == "external":
        _check_external(res)
    check_spec(res.inject or os.environ.get(INJECT))
    run_dir = prepare_run_dir(cfg.training.run_dir)
    setup_logging(run_dir, make_console(), args.debug, filename="driver.log")
    status = Driver(cfg, [*_config_argv(args), *extra], run_dir).run()
    logging.getLogger("megascale").info("%s", outcome(run_dir, cfg.training.steps, status))
    return status


def _check_external(res: Any) -> None:
    """Executors on other hosts must find the driver's store and know the job's id before it starts."""
    from urllib.parse import urlparse

    if res.job_id is None:
        raise ConfigError(
            "config: resilience.job_id must be set with resilience.executors = 'external' (every executor's "
            "--job gives the same id), e.g. --resilience.job_id=$SLURM_JOB_ID"
        )
    store = urlparse(res.store)
    if store.scheme == "tcp" and not store.port:
        raise ConfigError(
            f"config: resilience.store = {res.store!r} needs a fixed port with resilience.executors = "
            "'external' (the executors must know it), e.g. tcp://HEAD_HOST:29500"
        )


def cmd_executor(args: argparse.Namespace, extra: list[str]) -> int:
    from megascale.observe.progress import make_console, setup_logging

    if extra:
        raise ConfigError(
            f"executor takes no config overrides (the driver sends them), got {' '.join(extra)}"
        )
    args.run_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(args.run_dir, make_console(), args.debug, filename=f"executor-{args.node}.log")
    return executor_module.run_executor(args)


def cmd_trace_merge(args: argparse.Namespace, extra: list[str]) -> int:
    from megascale.observe.trace import merge_traces

    _no_overrides("trace merge", extra)
    print(f"wrote {merge_traces(args.run_dir, out=args.out)}")
    return 0


def cmd_trace_hang(args: argparse.Namespace, extra: list[str]) -> int:
    from megascale.observe.hang import HANG, analyze, describe, read_dumps
    from megascale.observe.trace import sessions

    _no_overrides("trace hang", extra)
    stalled = [session / HANG for session in sessions(args.run_dir) if (session / HANG).is_dir()]
    if not stalled:
        raise MegascaleError(
            f"trace hang: no rank of {args.run_dir} wrote a hang state (it is written after "
            "metrics.hang_dump_s seconds without a step)"
        )
    dumps = read_dumps(stalled[-1])
    print(f"{stalled[-1]}:")
    print(describe(dumps, analyze(dumps)))
    return 0


def cmd_report(args: argparse.Namespace, extra: list[str]) -> int:
    from megascale.observe.report import write_report

    _no_overrides("report", extra)
    print(f"wrote {write_report(args.run_dir, args.out)}")
    return 0


def cmd_evict(args: argparse.Namespace, extra: list[str]) -> int:
    from megascale.resilience.records import evict

    cfg = _load(args, extra)
    run_dir = Path(cfg.training.run_dir).expanduser()
    if not run_dir.is_dir():
        raise ConfigError(f"evict: run directory {run_dir} does not exist (set --training.run_dir)")
    print(f"blocklist of {run_dir}: {', '.join(evict(run_dir, args.node))}")
    return 0


def cmd_clean(args: argparse.Namespace, extra: list[str]) -> int:
    from megascale.checkpoint.staging import bytes_held, remove_stale, staging_base, stale

    _no_overrides("clean", extra)
    found = [(path, bytes_held(path)) for path in stale()] if args.dry_run else remove_stale()
    for path, size in found:
        print(f"{'would remove' if args.dry_run else 'removed'} {path} ({size / 1e6:.1f} MB)")
    total = sum(size for _, size in found)
    print(f"{len(found)} staging directories of dead processes in {staging_base()}, {total / 1e6:.1f} MB")
    return 0


def _no_overrides(verb: str, extra: list[str]) -> None:
    """Verbs that take no config fields refuse them by name."""
    if extra:
        raise ConfigError(f"{verb} takes no config overrides, got {' '.join(extra)}")


def cmd_rehearse(args: argparse.Namespace, extra: list[str]) -> int:
    if args.soak:
        from megascale.resilience.soak import run_soak

        return run_soak(args.work.expanduser().resolve(), args.soak, args.fault_every, args.seed, extra)
    return rehearsal_module.run_rehearsal(args, extra)


def _config_argv(args: argparse.Namespace) -> list[str]:
    return ["--config", args.config] if args.config else []


def cmd_prepare(args: argparse.Namespace, extra: list[str]) -> int:
    from megascale.data.prepare import prepare_dataset
    from megascale.data.shards import TokenShards

    cfg = _load(args, extra)
    dataset_dir = prepare_dataset(cfg.data, out_dir=args.out, progress=True)
    shards = TokenShards.open(dataset_dir, verify=False)
    print(
        f"{dataset_dir}: {shards.num_tokens:,} tokens in {shards.num_documents:,} documents, "
        f"vocabulary {shards.vocab_size}"
    )
    return 0


def cmd_generate(args: argparse.Namespace, extra: list[str]) -> int:
    from megascale.generate import generate

    _no_overrides("generate", extra)
    generate(
        Path(args.source),
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        tokenizer=args.tokenizer,
        device=args.device,
    )
    return 0


def cmd_eval(args: argparse.Namespace, extra: list[str]) -> int:
    from megascale.evaluate import evaluate

    score = evaluate(Path(args.source), extra, split=args.split, sequences=args.sequences, device=args.device)
    figures = {
        "loss": score.loss,
        "perplexity": score.perplexity,
        "bits_per_byte": score.bits_per_byte,
        "tokens": score.tokens,
        "bytes": score.bytes,
        "sequences": score.sequences,
    }
    print(
        f"{args.split}: loss {score.loss:.4f} | perplexity {score.perplexity:.2f} | "
        f"{score.bits_per_byte:.4f} bits per byte | {score.sequences:,} sequences, {score.tokens:,} tokens, "
        f"{score.bytes:,} bytes"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


def cmd_convert(args: argparse.Namespace, extra: list[str]) -> int:
    from megascale.convert import describe_export, describe_import, export_hf, import_hf

    _no_overrides("convert", extra)
    out = Path(args.output)
    if out.exists() and any(out.iterdir()) and not args.force:
        raise ConfigError(f"convert: output {out} exists and is not empty; pass --force to overwrite")
    if args.to_format == "hf":
        print(describe_export(export_hf(Path(args.source), out)))
    else:
        print(describe_import(Path(args.source), import_hf(Path(args.source), out)))
    return 0


def cmd_plan(args: argparse.Namespace, extra: list[str]) -> int:
    args.overrides = _split_overrides(extra)
    return plan_command.run(args)


def cmd_calibrate(args: argparse.Namespace, extra: list[str]) -> int:
    import torch

    from megascale.observe.peak import calibration_cache, measure_matmul_tflops, store_calibration

    _no_overrides("calibrate", extra)
    threads = args.threads or torch.get_num_threads()
    peaks = {dtype: measure_matmul_tflops(dtype, threads) for dtype in args.dtype}
    from megascale.calibrate import calibrate_profile, describe_measured, describe_peaks, profile_cache

    print("\n".join(describe_peaks(threads, peaks)), flush=True)
    measured = calibrate_profile(threads)  # raises, caching nothing, when a probe fails or times out
    for dtype, tflops in peaks.items():  # the peaks only with the profile measured beside them
        store_calibration(dtype, threads, tflops)
    print("\n".join(describe_measured(measured)))
    if measured["steal_fraction"] > 0.1:
        print(
            f"warning: the hypervisor gave {measured['steal_fraction']:.0%} of this machine's CPU time to "
            "other guests even in the least disturbed rounds of measurement, so these figures are slower "
            "than the machine; run `megascale calibrate` again when it is quieter"
        )
    if measured["memory_fresh_page_fraction"] < 0.9:
        print(
            f"warning: the memory probe faulted in {measured['memory_fresh_page_fraction']:.0%} of its "
            "results' pages, not all of them (huge pages, or an allocator that keeps freed memory), so "
            "its rate is above what the trainer's fresh results see and the planner will predict CPU "
            "runs short"
        )
    print(f"cached in {calibration_cache()} and {profile_cache()}")
    return 0


def _add_job_verbs(verbs: Any) -> None:
    """train, launch, executor: running a job."""
    train = verbs.add_parser(
        "train",
        help="Train a model (the built-in default with no flags); resumes "
        "from the newest checkpoint in training.run_dir.",
    )
    _add_config_args(train)
    train.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="Start N training processes on this machine (torchrun's machinery; gloo on CPU, NCCL on "
        "CUDA); the parallel.* layout must multiply to N. Leave at 1 under torchrun or srun.",
    )
    train.set_defaults(run=cmd_train)

    launch = verbs.add_parser(
        "launch",
        help="Run a training job under the resilience driver: executors per node, heartbeats, fault "
        "detection, diagnostics, eviction and automatic restart (docs/resilience.md).",
    )
    _add_config_args(launch)
    launch.set_defaults(run=cmd_launch)

    executor = verbs.add_parser(
        "executor",
        help="Serve one node of a `megascale launch` job started with resilience.executors = 'external': "
        "run on every host (by Slurm, Kubernetes or hand); it joins the driver through its store.",
    )
    executor_module.add_arguments(executor)
    executor.set_defaults(run=cmd_executor)


def _add_run_verbs(verbs: Any) -> None:
    """trace, report, evict, clean: working with a run and what it left."""
    trace = verbs.add_parser("trace", help="Work with the ranks' timelines (docs/observability.md).")
    trace_verbs = trace.add_subparsers(dest="trace_verb", metavar="WHAT", required=True)
    merge = trace_verbs.add_parser(
        "merge",
        help="Merge every rank's trace of a run into one Chrome trace JSON (open it in ui.perfetto.dev), "
        "ranks grouped by pipeline stage, data- and tensor-parallel rank.",
    )
    merge.add_argument("run_dir", type=Path, help="The run directory (training.run_dir).")
    merge.add_argument(
        "--out", type=Path, help="Where to write (default: merged.json in the newest trace session)."
    )
    merge.set_defaults(run=cmd_trace_merge)
    hang = trace_verbs.add_parser(
        "hang",
        help="Name the ranks a hung job waits for, from the state every rank wrote when it stalled "
        "(metrics.hang_dump_s).",
    )
    hang.add_argument("run_dir", type=Path, help="The run directory (training.run_dir).")
    hang.set_defaults(run=cmd_trace_hang)

    report = verbs.add_parser(
        "report",
        help="Write <run_dir>/report.html: one static page (works offline) with the run's curves, throughput "
        "and MFU, step-time breakdown, per-rank compute heat map, stragglers, faults and restarts.",
    )
    report.add_argument("run_dir", type=Path, help="The run directory (training.run_dir).")
    report.add_argument("--out", type=Path, help="Where to write (default: <run_dir>/report.html).")
    report.set_defaults(run=cmd_report)

    evict_parser = verbs.add_parser(
        "evict", help="Put a node on the job's blocklist (in training.run_dir): it is never used again."
    )
    _add_config_args(evict_parser)
    evict_parser.add_argument("node", help="The node's name, as in events.jsonl (e.g. node-1).")
    evict_parser.set_defaults(run=cmd_evict)

    clean = verbs.add_parser(
        "clean",
        help="Remove checkpoint staging in host memory (/dev/shm/megascale-*) whose processes are all gone.",
    )
    clean.add_argument("--dry-run", action="store_true", help="List what would be removed; remove nothing.")
    clean.set_defaults(run=cmd_clean)


def _add_data_verbs(verbs: Any) -> None:
    """prepare, convert: data and weights in and out."""
    prepare = verbs.add_parser(
        "prepare", help="Tokenize text (data.source) into memory-mapped shards (docs/data.md)."
    )
    _add_config_args(prepare)
    prepare.add_argument(
        "--out", metavar="DIR", help="Write the dataset here instead of the cache under data.cache_dir."
    )
    prepare.set_defaults(run=cmd_prepare)

    convert = verbs.add_parser(
        "convert",
        help="Convert weights to or from Hugging Face Llama, Mixtral, Qwen3 or Qwen3-MoE (safetensors).",
    )
    direction = convert.add_mutually_exclusive_group(required=True)
    direction.add_argument(
        "--to",
        dest="to_format",
        choices=["hf"],
        help="Export SOURCE (a run directory or one of its checkpoints) to a Hugging Face folder OUTPUT.",
    )
    direction.add_argument(
        "--from",
        dest="from_format",
        choices=["hf"],
        help="Import a Hugging Face "
        "folder SOURCE into a megascale checkpoint OUTPUT (use it with "
        "--checkpoint.init_from=OUTPUT).",
    )
    convert.add_argument("source", help="What to convert.")
    convert.add_argument("output", help="Where to write.")
    convert.add_argument("--force", action="store_true", help="Overwrite a non-empty OUTPUT.")
    convert.set_defaults(run=cmd_convert)


def _add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default="cpu",
        help="Where the model runs: 'cpu', 'auto' (the accelerator if there is one), 'cuda', ...",
    )


def _add_checkpoint_verbs(verbs: Any) -> None:
    """generate, eval: what a checkpoint has learnt."""
    generate = verbs.add_parser(
        "generate",
        help="Sample text from a run's newest checkpoint (or a checkpoint), of any layout, streaming it "
        "(docs/models.md).",
    )
    generate.add_argument("source", help="A run directory or one of its checkpoints.")
    generate.add_argument("--prompt", default="", help="Text the sample continues (default: none).")
    generate.add_argument("--max-new-tokens", type=int, default=200, help="Tokens to sample at most.")
    generate.add_argument(
        "--temperature", type=float, default=0.8, help="Softmax temperature; 0 takes the likeliest token."
    )
    generate.add_argument("--top-k", type=int, default=0, help="Draw from the k likeliest tokens (0: all).")
    generate.add_argument(
        "--top-p", type=float, default=1.0, help="Draw from the likeliest tokens up to this probability."
    )
    generate.add_argument("--seed", type=int, default=0, help="One seed, one text.")
    generate.add_argument(
        "--tokenizer",
        help="'byte' or a tokenizer.json, for a checkpoint whose run's dataset cannot be prepared again "
        "(default: the run's).",
    )
    _add_device_argument(generate)
    generate.set_defaults(run=cmd_generate)

    evaluate = verbs.add_parser(
        "eval",
        help="A checkpoint's loss, perplexity and bits per byte on a split of its run's dataset, or of "
        "another given by --data.* overrides (docs/models.md).",
    )
    evaluate.add_argument("source", help="A run directory or one of its checkpoints.")
    evaluate.add_argument("--split", default="validation", choices=["validation", "training"])
    evaluate.add_argument(
        "--sequences",
        type=int,
        help="Score the split's first N sequences (default: the run's training.val_sequences, as its "
        "validation; 0: all).",
    )
    evaluate.add_argument("--out", metavar="FILE", help="Also write the figures as JSON.")
    evaluate.epilog = "Overrides: --data.KEY=VALUE fields choose another dataset (same tokenizer)."
    _add_device_argument(evaluate)
    evaluate.set_defaults(run=cmd_eval)


def _add_measuring_verbs(verbs: Any) -> None:
    """plan, rehearse, calibrate: predicting, rehearsing and measuring."""
    plan = verbs.add_parser(
        "plan",
        help="Predict step time, tokens/s, MFU and memory of a job's layouts on a GPU cluster or this CPU, "
        "and print the best few (docs/planning.md).",
    )
    plan_command.add_arguments(plan)
    plan.epilog = OVERRIDES_HELP
    plan.set_defaults(run=cmd_plan)

    rehearse = verbs.add_parser(
        "rehearse",
        help="Do every fault the control plane must survive to a small launched job, from outside (signals, "
        "files, a full disk, a store restart), and write the table of what happened (docs/resilience.md).",
    )
    rehearsal_module.add_arguments(rehearse)
    rehearse.epilog = OVERRIDES_HELP
    rehearse.set_defaults(run=cmd_rehearse)

    calibrate = verbs.add_parser(
        "calibrate",
        help="Measure this CPU's matmul peak (for MFU) and what the planner's CPU profile needs (gloo "
        "latency and bandwidth, per-block host time), and cache them.",
    )
    calibrate.add_argument(
        "--dtype",
        nargs="+",
        default=["float32", "bfloat16"],
        choices=["float32", "bfloat16"],
        help="Dtypes to measure.",
    )
    calibrate.add_argument("--threads", type=int, help="Threads to measure with (default: torch's).")
    calibrate.set_defaults(run=cmd_calibrate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megascale",
        description="Pre-train decoder-only language models "
        "with 3D parallelism and automatic recovery (after ByteDance's MegaScale).",
    )
    parser.add_argument("--debug", action="store_true", help="Show tracebacks and debug logs.")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")

    _add_job_verbs(verbs)
    _add_run_verbs(verbs)
    _add_data_verbs(verbs)
    _add_checkpoint_verbs(verbs)
    _add_measuring_verbs(verbs)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # --debug may also come after the verb
    if "--debug" in extra:
        extra.remove("--debug")
        args.debug = True
    run: Callable | None = getattr(args, "run", None)
    if run is None:
        parser.print_help()
        return 2
    try:
        return run(args, extra)
    except MegascaleError as err:
        if args.debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        status = getattr(err, "exit_status", 2)
        if status == 2:  # the input's fault, which a restart would meet again (not a rollback's 3)
            from megascale.resilience.client import report_input_error

            report_input_error(str(err))
        from megascale.launch import under_launcher

        if under_launcher():
            # A rank: end now. The interpreter's teardown of the process groups waits on peers that are
            # ending too (seconds, under load), and a restart waits for this process to be gone.
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        return status


if __name__ == "__main__":
    sys.exit(main())
