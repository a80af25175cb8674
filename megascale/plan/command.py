"""`megascale plan`: the best layouts of a job on a cluster, predicted before the cluster is granted.

The job comes from a megascale config (`--config`, `--section.key=value` overrides), the cluster from
`--hardware` and `--devices`, the system from `--system` (`megascale.plan.systems`). It prints the fastest
layouts that fit, their step time, tokens/s, MFU, memory and where the time goes, the best one's
placement and the overrides that train it; `--explain` shows every term.
"""

from __future__ import annotations

import argparse
import sys

from megascale.errors import ConfigError

# Kept here (not imported from hardware.py) so that building the CLI's parser does not import torch; a test
# checks they match the profiles table.
HARDWARE = ("v100", "a100", "h100", "h800", "h200", "b200", "gb200", "cpu")
SYSTEM_NAMES = (
    "megascale", "megatron-lm", "megatron-core", "deepspeed", "torchtitan", "llm-foundry", "trainer",
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="megascale job config giving the model, data.seq_len, training.global_batch_size and dtype "
        "(e.g. configs/paper-175b.toml); default: the built-in defaults.",
    )
    parser.add_argument(
        "--hardware",
        default="a100",
        choices=HARDWARE,
        help="Device profile: datasheet figures for GPUs, or this CPU as `megascale calibrate` measured it.",
    )
    parser.add_argument("--devices", type=int, required=True, help="GPUs (or local processes on CPU).")
    parser.add_argument(
        "--system",
        choices=SYSTEM_NAMES,
        help="Which system runs the job, as the planner knows it (docs/planning.md, 'Systems'): 'megascale' "
        "(the paper's overlaps, fused kernels, async data), 'megatron-lm' (the paper's baseline), "
        "'megatron-core', 'deepspeed' (Megatron-DeepSpeed), 'torchtitan' (FSDP2, TP, PP, CP), "
        "'llm-foundry' (FSDP alone), 'trainer' (this repository's trainer today). "
        "Default: trainer on --hardware cpu, megascale otherwise.",
    )
    parser.add_argument("--batch", type=int, help="Global batch in sequences (default: the config's).")
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        help="Compute precision, whose peak MFU divides by (default: bfloat16 on GPUs, float16 on V100, "
        "whatever a config sets; the config's training.dtype on --hardware cpu).",
    )
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="The blocks' linear layers in float8 at the profile's float8 peak (default: what the config's "
        "training.fp8 says); the rest, and the MFU's peak, stay in --dtype.",
    )
    parser.add_argument(
        "--nic-gbps",
        type=float,
        help="NIC rate per GPU in Gb/s, one direction (default: the profile's: 50 on V100, 200 on A100, 400 "
        "on H- and B-class).",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        help="GPUs per node sharing NVLink (default: the profile's: 8; 16 on V100 (DGX-2), 72 on GB200).",
    )
    parser.add_argument(
        "--straggler-hosts",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="Share of hosts that compute slower (the MegaScale paper saw about 0.005, §5.1); default 0: a "
        "healthy cluster.",
    )
    parser.add_argument(
        "--straggler-slowdown",
        type=float,
        default=0.10,
        metavar="FRACTION",
        help="How much slower a straggling host computes (default 0.10, MegaScale's §6.3).",
    )
    top_help = "How many splits of the devices (tp, pp, dp, cp) to print, each at its fastest (default 5)."
    parser.add_argument("--top", type=int, default=5, help=top_help)
    parser.add_argument("--tp", type=int, help="Only layouts with this tensor-parallel degree.")
    parser.add_argument("--pp", type=int, help="Only layouts with this many pipeline stages.")
    parser.add_argument(
        "--cp",
        type=int,
        help="Only layouts with this context-parallel degree (the search offers cp > 1 for long sequences "
        "only; see docs/planning.md, 'Context parallelism').",
    )
    config_layout = "Predict the config's own parallel layout instead of searching."
    parser.add_argument("--config-layout", action="store_true", help=config_layout)
    parser.add_argument("--explain", action="store_true", help="Show every term of the best layout's step.")


def run(args: argparse.Namespace) -> int:
    """Print the plan; a ConfigError (one line) for anything the user can fix."""
    from megascale.plan.report import plan_and_render  # torch and the model come in here, not in the parser

    counts = ("devices", "top", "batch", "gpus_per_node", "cp", "tp", "pp")
    for flag, value in ((f"--{name.replace('_', '-')}", getattr(args, name)) for name in counts):
        if value is not None and value < 1:
            raise ConfigError(f"plan: {flag} {value} must be >= 1")
    if args.nic_gbps is not None and args.nic_gbps <= 0:
        raise ConfigError(f"plan: --nic-gbps {args.nic_gbps} must be > 0")
    for flag, value in (
        ("--straggler-hosts", args.straggler_hosts),
        ("--straggler-slowdown", args.straggler_slowdown),
    ):
        if not 0 <= value <= 1:
            raise ConfigError(f"plan: {flag} {value} must be between 0 and 1")
    sys.stdout.write(plan_and_render(args))
    return 0
