"""The cost model against the MegaScale paper's published numbers: Table 2, Figure 9, Table 3."""

from pathlib import Path

import pytest

from megascale.config import load_config
from megascale.plan import paper

REPO = Path(__file__).resolve().parents[2]
TOLERANCE_POINTS = 3.0


def print_rows(title, rows):
    print(f"\n{title}")
    for row in rows:
        print(
            f"  {row.label:<24} {row.gpus:>6} GPUs batch {row.batch:>5}: "
            f"published {100 * row.published_mfu:5.1f}%"
            f"  predicted {100 * row.predicted_mfu:5.1f}%  error {row.error_points:+5.1f} points"
        )


def test_table_2_all_sixteen_rows_within_three_points():
    rows = paper.table_2()
    print_rows("Table 2 (175B strong scaling)", rows)
    assert len(rows) == 16
    assert [row.published_mfu for row in rows] == [mfu for *_, mfu in paper.TABLE_2]
    assert max(abs(row.error_points) for row in rows) <= TOLERANCE_POINTS


def test_table_2_megascale_beats_megatron_at_every_scale():
    rows = paper.table_2()
    megatron = {(row.batch, row.gpus): row.predicted_mfu for row in rows if row.label == "Megatron-LM"}
    megascale = {(row.batch, row.gpus): row.predicted_mfu for row in rows if row.label == "MegaScale"}
    assert all(megascale[point] > megatron[point] for point in megatron)


def test_figure_9_530b_weak_scaling_within_three_points():
    rows = paper.figure_9()
    print_rows("Figure 9 (530B weak scaling)", rows)
    assert [row.gpus for row in rows] == [2240, 2240, 4480, 4480, 11200, 11200]
    assert max(abs(row.error_points) for row in rows) <= TOLERANCE_POINTS


def test_table_3_each_ablation_step_raises_mfu_in_the_published_order():
    rows = paper.table_3()
    print("\nTable 3 (ablation, 175B on 256 GPUs)")
    for previous, row in zip([None, *rows], rows):
        published = "" if previous is None else f"{100 * (row.published_mfu - previous.published_mfu):+.1f}"
        predicted = "" if previous is None else f"{100 * (row.predicted_mfu - previous.predicted_mfu):+.1f}"
        print(
            f"  {row.label:<22} published {100 * row.published_mfu:5.1f}% ({published:>5})  "
            f"predicted {100 * row.predicted_mfu:5.1f}% ({predicted:>5})"
        )
    assert [row.label for row in rows] == [name for name, _ in paper.TABLE_3]
    deltas = [after.predicted_mfu - before.predicted_mfu for before, after in zip(rows, rows[1:])]
    assert all(delta > 0 for delta in deltas)  # every step's sign matches the paper's (all positive)
    assert max(abs(row.error_points) for row in rows) <= 4.0  # not an acceptance bound; a sanity one


def test_the_paper_dense_flops_per_token_match_the_published_accounting():
    from megascale.models.flops import flops_per_token

    assert flops_per_token(paper.MODEL_175B, paper.SEQ_LEN) == pytest.approx(1.077e12, rel=1e-3)


@pytest.mark.parametrize(
    ("name", "model"), [("paper-175b", paper.MODEL_175B), ("paper-530b", paper.MODEL_530B)]
)
def test_the_shipped_configs_hold_the_paper_models(name, model):
    cfg = load_config(REPO / "configs" / f"{name}.toml")
    assert cfg.model == model
    assert cfg.data.seq_len == paper.SEQ_LEN


def test_docs_show_the_tables_the_code_produces():
    docs = (REPO / "docs" / "planning.md").read_text()
    assert paper.render_markdown() in docs, "regenerate with: python -m megascale.plan.paper"
