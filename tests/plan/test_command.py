"""`megascale plan` from the command line: the table, --explain, the placement, and one-line errors."""

from pathlib import Path

import pytest

from megascale.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]
PAPER_175B = str(REPO / "configs" / "paper-175b.toml")
LONG_CONTEXT = str(REPO / "configs" / "long-context.toml")  # parallel.cp = 2, sequence 1,024


def plan(capsys, *argv):
    status = main(["plan", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_plan_prints_the_best_layouts_placement_and_overrides(capsys):
    status, out, _ = plan(capsys, "--config", PAPER_175B, "--devices", "256", "--batch", "768", "--top", "3")
    assert status == 0
    lines = out.splitlines()
    assert (
        "176B parameters" in lines[0]
        and "256 x A100-SXM4-80GB" in lines[0]
        and "system megascale" in lines[0]
    )
    rows = [line for line in lines if line.lstrip()[:2] in ("1 ", "2 ", "3 ")]
    assert len(rows) == 3 and all("%" in row for row in rows)
    assert "placement of #1: rank order tp-dp-pp" in out
    assert "train #1 with: --parallel.tp=" in out and "--parallel.rank_order=tp-dp-pp" in out


def test_the_listed_layouts_are_different_splits_of_the_devices(capsys):
    # Each line is a choice between splits: one split's other micro-batch sizes or chunk counts are not
    # alternatives to list (the 175B job's fastest plans are one split's chunk counts).
    status, out, _ = plan(capsys, "--config", PAPER_175B, "--devices", "256", "--batch", "768", "--top", "5")
    assert status == 0
    rows = [line.split() for line in out.splitlines() if line.lstrip()[:2] in ("1 ", "2 ", "3 ", "4 ", "5 ")]
    splits = [tuple(word for word in row if word[:2] in ("tp", "pp", "dp", "cp")) for row in rows]
    assert len(splits) == 5 and len(set(splits)) == 5, splits


def test_explain_lists_every_term_memory_and_the_profile(capsys):
    status, out, _ = plan(
        capsys,
        "--config",
        PAPER_175B,
        "--devices",
        "12288",
        "--config-layout",
        "--explain",
        "--system",
        "megatron-lm",
    )
    assert status == 0
    assert "tp8 pp8 v6 dp192 mb1 zero2" in out
    for term in (
        "gemm",
        "tp_exposed",
        "pp_exposed",
        "dp_exposed",
        "bubble",
        "stragglers",
        "optimizer",
        "host",
    ):
        assert f"\n  {term} " in out
    assert "memory per device at the step's peak: weights" in out and "(NVIDIA A100 datasheet" in out
    assert "\n  gemm_efficiency = 0.68\n" in out


def test_overrides_change_the_model(capsys):
    _, dense, _ = plan(capsys, "--config", PAPER_175B, "--devices", "12288", "--config-layout")
    _, windowed, _ = plan(
        capsys,
        "--config",
        PAPER_175B,
        "--devices",
        "12288",
        "--config-layout",
        "--model.attention.window=512",
    )
    assert "1.077e+12 FLOPs/token" in dense and "1.056e+12 FLOPs/token" in windowed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--devices", "0"], "plan: --devices 0 must be >= 1"),
        (["--devices", "8", "--batch", "0"], "plan: --batch 0 must be >= 1"),
        (
            ["--devices", "8", "--hardware", "cpu"],
            "run `megascale calibrate --dtype float32 --threads 1` first",
        ),
        (["--devices", "3", "--config", PAPER_175B, "--config-layout"], "--devices 3 is not a multiple of"),
        (["--devices", "8", "--config", PAPER_175B, "--batch", "8"], "plan: no layout fits"),
        (["--devices", "8", "--model.nope=1"], "model.nope"),
        (
            ["--devices", "3", "--config", LONG_CONTEXT, "--config-layout"],
            "--devices 3 is not a multiple of parallel.tp x parallel.pp x parallel.cp = 2",
        ),
        (
            ["--devices", "2", "--config", LONG_CONTEXT, "--config-layout", "--data.seq_len=1022"],
            "sequence 1022 does not split into 2 x cp = 4 equal chunks",
        ),
        (["--devices", "8", "--cp", "0"], "plan: --cp 0 must be >= 1"),
        (["--devices", "8", "--tp", "0"], "plan: --tp 0 must be >= 1"),
        (["--devices", "16", "--hardware", "h100", "--tp", "16"], "--tp 16 is not a degree 16 devices"),
        (["--devices", "8", "--nic-gbps", "0"], "plan: --nic-gbps 0.0 must be > 0"),
        (["--devices", "8", "--gpus-per-node", "0"], "plan: --gpus-per-node 0 must be >= 1"),
        (["--devices", "8", "--straggler-hosts", "2"], "plan: --straggler-hosts 2.0 must be between 0 and 1"),
    ],
)
def test_mistakes_are_one_line_naming_the_flag_and_the_fix(capsys, argv, message):
    status, out, err = plan(capsys, *argv)
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and message in err


def test_every_plan_flag_has_help():
    parser = build_parser()
    plan_parser = parser._subparsers._group_actions[0].choices["plan"]
    for action in plan_parser._actions:
        assert action.help, action.option_strings


def test_a_gpu_plan_states_its_assumptions_in_bf16_without_stragglers_unless_asked(capsys):
    status, out, _ = plan(capsys, "--config", PAPER_175B, "--devices", "1024", "--batch", "768", "--top", "1")
    assert status == 0
    assumed = out.splitlines()[1]
    assert assumed.startswith("assumed: bfloat16 at 312 TFLOP/s") and "stragglers none" in assumed
    assert "NIC 200 Gb/s per device" in assumed and "8 per node" in assumed
    _, slow_network, _ = plan(
        capsys, "--config", PAPER_175B, "--devices", "1024", "--batch", "768", "--top", "1",
        "--config-layout", "--system", "megatron-lm", "--nic-gbps", "25", "--straggler-hosts", "0.01",
    )  # fmt: skip
    _, fast_network, _ = plan(
        capsys, "--config", PAPER_175B, "--devices", "1024", "--batch", "768", "--top", "1",
        "--config-layout", "--system", "megatron-lm",
    )  # fmt: skip
    assert "NIC 25 Gb/s" in slow_network and "0.01 of hosts 10% slower" in slow_network
    step = lambda out: float(out.splitlines()[3].split()[-8])  # noqa: E731
    assert step(slow_network) > step(fast_network)


def test_a_config_with_context_parallelism_plans_its_own_layout(capsys):
    """configs/long-context.toml splits each sequence over a ring of 2: on 2 GPUs that is dp 1 x cp 2,
    its ring's exposed time is a term, the placement says where the ring sits, and the overrides keep it."""
    status, out, _ = plan(capsys, "--config", LONG_CONTEXT, "--devices", "2", "--config-layout", "--explain")
    assert status == 0
    assert "tp1 pp1 dp1 cp2 mb4" in out and "overlapped: tp, pp, dp, cp" in out
    assert "\n  cp_exposed " in out
    assert "CP groups span 1 node(s) in 1 pod(s)" in out
    assert "--parallel.cp=2" in out


def _best_step_s(out: str) -> float:
    """The predicted step time of the first layout a plan prints."""
    row = next(line for line in out.splitlines() if line.lstrip().startswith("1 "))
    return float(row.split()[-8])


def test_float8_linear_layers_plan_at_the_float8_peak_and_no_float8_device_refuses(capsys):
    args = ["--config", PAPER_175B, "--devices", "256", "--batch", "256", "--top", "1", "--config-layout"]
    _, bf16, _ = plan(capsys, "--hardware", "h100", *args)
    status, fp8, _ = plan(capsys, "--hardware", "h100", "--fp8", *args)
    assert status == 0
    assert "assumed: bfloat16 at 989 TFLOP/s peak per device (linear layers float8 at 1979)" in fp8
    # The GEMMs halve, not the step: attention, communication and the casts stay.
    assert 0.5 * _best_step_s(bf16) < _best_step_s(fp8) < 0.9 * _best_step_s(bf16)
    status, _, err = plan(capsys, "--hardware", "a100", "--fp8", *args)
    assert status == 2 and "A100-SXM4-80GB has no float8 peak (asked by --fp8" in err
    _, from_config, _ = plan(capsys, "--hardware", "h100", "--training.fp8=tensorwise", *args)
    assert _best_step_s(from_config) == _best_step_s(fp8)


@pytest.mark.parametrize(
    ("hardware", "assumed"),
    [
        ("v100", "assumed: float16 at 125 TFLOP/s peak per device; 16 per node"),
        ("b200", "assumed: bfloat16 at 2250 TFLOP/s peak per device; 8 per node"),
        ("gb200", "assumed: bfloat16 at 2500 TFLOP/s peak per device; 72 per node"),
    ],
)
def test_every_gpu_generation_plans_in_its_own_precision_and_node(capsys, hardware, assumed):
    status, out, _ = plan(
        capsys, "--config", PAPER_175B, "--devices", "512", "--batch", "512", "--hardware", hardware
    )
    assert status == 0 and out.splitlines()[1].startswith(assumed)


def test_a_plan_says_how_its_mfu_counts_attention(capsys):
    """At 131,072 tokens Llama 3.1 8B's attention, counted unhalved, is 12 x 32 x 4,096 x 131,072 =
    2.06e11 FLOPs a token against 6N = 4.5e10 for its 7.5B matmul weights: 82%, of which a causal kernel
    runs half, so the devices run 59% of what the MFU counts; at 8,192 tokens 22%."""
    long_context = ["--data.seq_len=131072", "--model.max_seq_len=131072"]
    args = ["--config", str(REPO / "configs" / "llama3.1-8b.toml"), "--hardware", "h100", "--top", "1"]
    status, out, _ = plan(capsys, *args, "--devices", "64", "--batch", "16", *long_context)
    assert status == 0
    assert "82% of these FLOPs are attention's, of which a causal kernel runs 50%" in out
    assert "the devices run 59% of the FLOPs the MFU counts" in out
    status, out, _ = plan(capsys, *args, "--devices", "8")
    assert status == 0 and "22% of these FLOPs are attention's" in out


@pytest.mark.parametrize("system", ["megatron-core", "deepspeed", "torchtitan", "llm-foundry"])
def test_the_systems_of_the_published_runs_are_planned_by_name(capsys, system):
    status, out, _ = plan(
        capsys, "--config", PAPER_175B, "--devices", "512", "--batch", "512", "--hardware", "h100",
        "--top", "1", "--system", system,
    )  # fmt: skip
    assert status == 0 and f"system {system}" in out.splitlines()[0]
    if system == "llm-foundry":  # FSDP alone
        assert "tp1 pp1 dp512" in out
