"""The planner on published runs (megascale/plan/validation.py reading tests/plan/published/): each row's
published figures are its source's own, the papers' tables stay within 3 points, the validation set and
llm-foundry's hold-out tables within the bounds the planner holds, and the docs show what the command
prints."""

import dataclasses
import functools
import shutil
from pathlib import Path

import pytest

from megascale.errors import ConfigError
from megascale.models.flops import num_params
from megascale.plan import validation
from megascale.plan.command import SYSTEM_NAMES
from megascale.plan.systems import SYSTEMS
from megascale.plan.validation import DATA, Published, error_summary, load_table, load_tables
from tests.plan.paper import MODEL_175B, MODEL_530B, with_ptb_swa

REPO = Path(__file__).resolve().parents[2]


@functools.cache
def table(file: str) -> dict[str, Published]:
    return {row.label: row for row in load_table(DATA / file).rows}


def rows_of(published_set: str) -> list[Published]:
    return [row for t in load_tables() if t.source.set == published_set for row in t.rows]


def test_every_table_names_a_system_the_command_line_takes():
    assert list(SYSTEMS) == list(SYSTEM_NAMES)
    tables = load_tables()
    assert len(tables) == len(list(DATA.glob("*.toml"))) == 20
    assert {row.system for t in tables for row in t.rows} <= set(SYSTEM_NAMES)
    assert [t.source.set for t in tables] == sorted((t.source.set for t in tables), key=validation.SETS.index)


def test_a_rows_published_figures_are_its_sources_own():
    korthikanti = table("korthikanti2022-table5.toml")["530B tp8 pp35 on 280, selective recompute"]
    assert korthikanti.step_s == 37.83 and korthikanti.mfu == pytest.approx(0.560, abs=0.001)
    assert table("sc21-table1.toml")["1008B tp8 pp64 on 3072"].mfu == pytest.approx(0.52, abs=0.005)
    assert table("megatron-core-r0.8-h100.toml")["462B tp8 pp16 on 6,144"].mfu == pytest.approx(
        0.465, abs=0.001
    )
    assert table("llm-foundry-h100-large.toml")["MPT-7b on 128"].mfu == pytest.approx(0.4571, abs=0.003)
    titan = table("torchtitan-a100.toml")["Llama 3 8B, recompute selective op"]
    assert titan.mfu == pytest.approx(0.582, abs=0.003)
    a100 = table("llm-foundry-a100-80gb.toml")["MPT-7b at 2,048 on 8, micro-batch 6"]
    assert a100.mfu == pytest.approx(0.6423, abs=0.002)
    h100 = table("llm-foundry-h100-bf16.toml")["MPT-1b at 65,536 on 8, micro-batch 1"]
    assert h100.mfu == pytest.approx(0.2634, abs=0.002)  # attention unhalved
    nemo = {label.split(" tp")[0]: row for label, row in table("nemo-24.07-h100-fp8.toml").items()}
    assert nemo["Llama 2 70B"].mfu * 989 == pytest.approx(759, rel=0.01)  # its model TFLOP/s
    long = list(table("nemo-24.03-long-sequence.toml").values())
    assert [row.job.seq_len for row in long] == [4096 * 2**k for k in range(9)]
    assert all(row.job.tokens_per_step == 2**22 and row.job.fp8 for row in long)
    assert long[-1].mfu * 989 == pytest.approx(536)


def test_the_papers_tables_are_the_paper_models_on_their_setup():
    table_2 = list(table("megascale-table2.toml").values())
    assert len(table_2) == 16
    megatron, megascale = table_2[0].job.model, table_2[-1].job.model
    assert (megatron, megascale) == (MODEL_175B, with_ptb_swa(MODEL_175B))  # max_seq_len 2048 in both
    assert all(row.job.model in (megatron, megascale) for row in table_2)
    assert {row.job.model.n_layers for row in table("megascale-figure9.toml").values()} == {
        MODEL_530B.n_layers
    }
    row = table_2[0]  # Megatron-LM on 256: the dense model's 1.077e12 FLOPs a token, 40 s at 53.0%
    assert row.flops_per_step / row.job.tokens_per_step == pytest.approx(1.077e12, rel=1e-3)
    assert (row.step_s, row.mfu) == (40.0, 0.53)
    assert (row.cluster.straggler_host_fraction, row.cluster.straggler_slowdown) == (0.005, 0.10)


@pytest.mark.parametrize("file", ["megascale-table2.toml", "megascale-figure9.toml"])
def test_the_tables_the_gemm_efficiency_was_fitted_on_are_within_three_points(file):
    assert max(abs(row.error_points) for row in table(file).values()) <= 3.0


def test_the_megascale_ablation_raises_mfu_at_every_published_step():
    rows = list(table("megascale-table3.toml").values())
    assert [row.label for row in rows][-1] == "LAMB (batch x3)"
    assert all(after.predicted_mfu > before.predicted_mfu for before, after in zip(rows, rows[1:]))
    assert max(abs(row.error_points) for row in rows) <= 4.0


def test_the_validation_set_is_predicted_without_a_systematic_sign():
    rows = rows_of("validation")
    mean_abs, mean, worst = error_summary(rows)
    print(f"{len(rows)} rows: mean absolute error {mean_abs:.1f}, mean {mean:+.1f}, worst {worst:+.1f}")
    assert len(rows) == 48 and mean_abs <= 4.0 and abs(mean) <= 2.0 and abs(worst) <= 8.0


@pytest.mark.parametrize(
    "file", ["llm-foundry-a100-80gb.toml", "llm-foundry-a100-40gb.toml", "llm-foundry-h100-bf16.toml"]
)
def test_llm_foundrys_hold_out_tables_stay_within_the_validation_sets_average_bounds(file):
    mean_abs, mean, _ = error_summary(list(table(file).values()))
    assert mean_abs <= 4.0 and abs(mean) <= 2.0


def test_sc21s_rows_reduce_float16_gradients_as_its_scripts_trained():
    """SC'21's scripts train in --fp16, and Megatron-LM of 2021 kept gradients in float32 only under bf16:
    its 39B row (pp 2, Megatron-LM's own DDP after the backward) waits for a float16 all-reduce of each
    rank's 39B / 16 parameters over 32 nodes, half the bytes of a float32 one."""
    row = table("sc21-table1.toml")["39B tp8 pp2 on 512"]
    assert row.job.precision.grad_bytes == 2
    float32 = dataclasses.replace(row.job.precision, grad_bytes=4)
    as_float32 = dataclasses.replace(row, job=dataclasses.replace(row.job, precision=float32))
    reduce_s = as_float32.predicted.terms_s["dp_exposed"] - row.predicted.terms_s["dp_exposed"]
    link = row.profile.inter_node_bytes_per_s * row.profile.network_efficiency
    assert reduce_s == pytest.approx(31 / 32 * 2 * num_params(row.job.model) / 16 / link, rel=0.02)


def test_llama_3s_long_context_layout_is_expressed_and_predicted_within_8_points():
    """Table 4's row at 131,072 positions: TP 8 x CP 16 x PP 16 x DP 8 on 16,384 GPUs, 16M tokens a step
    at 380 TFLOP/s per GPU, 38% of 989 under PaLM's FLOPs (attention's 12 L h s unhalved)."""
    (row,) = [row for row in table("llama3-405b-table4.toml").values() if row.layout.cp > 1]
    assert (row.layout.tp, row.layout.cp, row.layout.pp, row.layout.dp, row.gpus) == (8, 16, 16, 8, 16384)
    assert row.job.tokens_per_step == 16 * 2**20 and row.mfu == pytest.approx(0.38, abs=0.005)
    assert row.predicted.terms_s["cp_exposed"] > 0 and abs(row.error_points) <= 8


def test_torchtitans_h100_rows_compile_float8_and_run_below_the_sxm_peak_their_mfu_divides_by():
    """Tables 1 and 3: compiling leaves the GEMMs and shortens the element-wise work; Float8 runs the GEMMs
    at the float8 rate and gathers a byte an element; the power-capped GPUs compute at 912 TFLOP/s while
    the MFU divides by the SXM's 989."""
    rows = table("torchtitan-h100-fsdp.toml")
    eager, compiled, float8 = (
        rows[f"Llama 3.1 8B on 128, {t}"].predicted
        for t in ("FSDP", "FSDP + torch.compile", "FSDP + torch.compile + Float8")
    )
    assert compiled.terms_s["gemm"] == eager.terms_s["gemm"]
    assert compiled.terms_s["elementwise"] < 0.8 * eager.terms_s["elementwise"]
    assert float8.terms_s["gemm"] < 0.6 * compiled.terms_s["gemm"]
    row = rows["Llama 3.1 8B on 128, FSDP + torch.compile + Float8"]
    assert row.job.fp8_all_gather and row.job.precision.block_gather_bytes == 1
    assert 835e12 < row.profile.peak_flops("bfloat16") < 989e12 and row.mfu_peak_flops == 989e12
    assert 256 * 8192 / (row.step_s * 128) == pytest.approx(8380)


def test_torchtitans_multi_dimensional_rows_run_as_its_code_configures_them():
    rows = table("torchtitan-h100-multi-d.toml")
    interleaved = rows["Llama 3.1 405B, FSDP 8, TP 8, PP 8, interleaved, sequence 8,192"]
    layout = interleaved.layout
    assert (layout.tp, layout.pp, layout.dp, layout.virtual_stages, layout.micro_batch) == (8, 8, 8, 2, 4)
    assert layout.zero_stage == 2 and layout.micro_batches(interleaved.job) == 8
    two_d = rows["Llama 3.1 70B, FSDP 32, TP 8, sequence 8,192"]
    async_tp = rows["Llama 3.1 70B, FSDP 32, TP 8, async TP, sequence 8,192"]
    assert not two_d.features.tp_overlap and async_tp.features.tp_overlap
    assert async_tp.predicted.terms_s["tp_exposed"] < two_d.predicted.terms_s["tp_exposed"]


def test_megatron_bridges_rows_run_their_tables_layouts_on_their_own_devices():
    rows = list(table("megatron-bridge-25.11-llama.toml").values())
    assert {row.profile.name for row in rows} == {"H100-SXM5-80GB", "B200-SXM-180GB", "GB200-NVL72"}
    assert all(
        row.job.fp8 and row.job.precision.grad_bytes == 2 and row.features.uneven_stages for row in rows
    )
    row_405b = next(row for row in rows if "405B on H100" in row.label)
    assert (row_405b.layout.tp, row_405b.layout.pp, row_405b.layout.cp, row_405b.gpus) == (8, 8, 2, 1024)
    assert row_405b.mfu * 989 == pytest.approx(737, rel=0.05)  # the table's model TFLOP/s


def test_megatron_bridges_qwen3_rows_reproduce_their_model_tflops():
    """Tokens/s times NVIDIA's FLOPs (6 x the active parameters, causal attention halved) gives the
    table's model TFLOP/s within 1%."""
    rows = list(table("megatron-bridge-25.11-qwen3.toml").values())
    tflops = [row.flops_per_step / row.step_s / row.gpus / 1e12 for row in rows]
    assert tflops == pytest.approx([121, 233, 214, 484, 547, 728], rel=0.01)
    assert [row.features.ep_overlap for row in rows] == ["batch", "batch", "none", "batch", "none", "none"]
    assert [row.job.fp8 for row in rows] == [True] * 5 + [False]


def test_the_memory_model_finds_room_for_nearly_every_published_layout():
    """Every published layout ran; four need more than their device in the memory model: Llama 3's 405B
    at dp 64 (its schedule and recomputation unstated), NeMo's Llama 3 8B at cp 2 (80.3 GB of 80),
    Megatron-Bridge's 405B on GB200s (its pipeline counts the embedding and loss as layers) and its Qwen3
    235B on B200s (its experts ran in float8 and kept their inputs so)."""
    rows = [row for t in load_tables() for row in t.rows]
    too_big = {row.label for row in rows if row.predicted.memory.total_bytes > row.profile.hbm_bytes}
    assert too_big == {
        "405B tp8 pp16 dp64 on 8,192",
        "Llama 3 8B tp1 pp1 dp4 cp2 mb1 zero1 recompute=selective",
        "Llama 3.1 405B on GB200-NVL72 tp4 pp16 v4 dp4 mb1 zero1 recompute=selective",
        "Qwen3 235B-A22B on B200-SXM-180GB tp1 pp8 v2 dp8 ep8 mb1 zero1 recompute=none",
    }


def test_a_run_the_search_cannot_fit_does_not_agree_and_a_malformed_one_raises():
    rows = table("llm-foundry-h100-bf16.toml")
    assert rows["MPT-30b at 8,192 on 8, micro-batch 1"].search_agrees() is False
    assert rows["MPT-7b at 2,048 on 8, micro-batch 6"].search_agrees() is True
    row = rows["MPT-7b at 2,048 on 8, micro-batch 6"]
    malformed = dataclasses.replace(row, job=dataclasses.replace(row.job, global_batch=row.gpus + 1))
    with pytest.raises(ConfigError, match="no legal layout"):
        malformed.search_agrees()


def test_another_folder_of_tables_is_read_with_data_and_a_typo_is_refused(tmp_path, capsys):
    shutil.copy(DATA / "bloom-176b.toml", tmp_path)
    assert validation.main(["--data", str(tmp_path), "--no-search"]) == 0
    out = capsys.readouterr().out
    assert "| validation | BLOOM-176B, Megatron-DeepSpeed | deepspeed | 1 |" in out and "176B tp4 pp12" in out
    text = (tmp_path / "bloom-176b.toml").read_text().replace("step_s = ", "step_seconds = ")
    (tmp_path / "bloom-176b.toml").write_text(text)
    with pytest.raises(ConfigError, match="unknown keys"):
        validation.load_tables(tmp_path)
    with pytest.raises(ConfigError, match="--data DIR"):
        validation.load_tables(tmp_path / "missing")


@pytest.mark.xdist_group("published_tables")  # on the worker that searched them for the search's test
def test_docs_show_the_tables_the_command_prints(published_tables):
    docs = (REPO / "docs" / "planning.md").read_text()
    printed = validation.render_markdown(published_tables)
    assert printed in docs, "regenerate with: python -m megascale.plan.validation"
