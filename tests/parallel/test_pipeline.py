"""The pipeline's layer split and stage placement (the schedules themselves are tested end to end by the
parity matrix, tests/parallel/test_parity_matrix.py, at two ranks; the zero-bubble ones here at four)."""

import pytest

from megascale.layout import split_layers, stage_ids_of
from megascale.models import sharding
from megascale.models.llama import Transformer
from megascale.parallel.pipeline import build_stage_module, stage_layer_ranges
from tests.parallel import config_space
from tests.parallel.parity_matrix import Matrix
from tests.parallel.tiny import tiny_model_config


def test_equal_weights_split_evenly_with_the_remainder_on_early_stages():
    assert split_layers([1] * 8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert split_layers([1] * 7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert split_layers([1] * 3, 3) == [range(0, 1), range(1, 2), range(2, 3)]


def test_extras_on_first_and_last_stage_move_layers_to_the_middle():
    # Embedding worth 2 layers on stage 0 and an output layer worth 2 on the last stage.
    assert split_layers([1] * 8, 4, first_extra=2, last_extra=2) == [
        range(0, 1),
        range(1, 4),
        range(4, 7),
        range(7, 8),
    ]


def test_the_heaviest_stage_is_as_light_as_possible():
    weights = [5, 1, 1, 1, 1, 5]
    ranges = split_layers(weights, 3)
    assert max(sum(weights[i] for i in r) for r in ranges) == 5
    assert [len(r) for r in ranges] == [1, 4, 1]


def test_every_stage_needs_a_layer():
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 stages"):
        split_layers([1, 1], 3)


def test_looped_placement_of_virtual_stages():
    assert [stage_ids_of(rank, 2, 2) for rank in range(2)] == [[0, 2], [1, 3]]
    assert [stage_ids_of(rank, 4, 1) for rank in range(4)] == [[0], [1], [2], [3]]


def test_v_placement_holds_the_first_and_last_stage_on_rank_zero():
    for schedule in ("zbv", "dualpipev"):
        assert [stage_ids_of(rank, 2, 2, schedule) for rank in range(2)] == [[0, 3], [1, 2]]
        assert [stage_ids_of(rank, 4, 2, schedule) for rank in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_params_split_counts_the_embedding_and_output_layer():
    model = Transformer(tiny_model_config(n_layers=4))
    assert stage_layer_ranges(model, 2, "uniform", blocks=sharding.BLOCKS) == [range(0, 2), range(2, 4)]
    # Vocabulary 96 x dim 64 on each end is ~0.2 of a block: still 2 + 2.
    assert stage_layer_ranges(model, 2, "params", blocks=sharding.BLOCKS) == [range(0, 2), range(2, 4)]
    wide_vocab = Transformer(tiny_model_config(n_layers=4, vocab_size=4096))
    assert stage_layer_ranges(wide_vocab, 2, "params", blocks=sharding.BLOCKS) == [range(0, 2), range(2, 4)]
    assert stage_layer_ranges(wide_vocab, 3, "params", blocks=sharding.BLOCKS) == [
        range(0, 1),
        range(1, 3),
        range(3, 4),
    ]


def test_a_stage_keeps_its_layers_names_and_only_its_end_modules():
    model = Transformer(tiny_model_config(n_layers=4))
    middle = build_stage_module(
        model,
        range(1, 3),
        first=False,
        last=False,
        blocks=sharding.BLOCKS,
        first_stage_modules=sharding.FIRST_STAGE,
        last_stage_modules=sharding.LAST_STAGE,
    )
    assert list(middle.layers.keys()) == ["1", "2"]
    assert middle.tok_embeddings is None and middle.norm is None and middle.output is None
    names = {name for name, _ in middle.named_parameters()}
    assert names and names <= {name for name, _ in model.named_parameters()}
    last = build_stage_module(
        model,
        range(3, 4),
        first=False,
        last=True,
        blocks=sharding.BLOCKS,
        first_stage_modules=sharding.FIRST_STAGE,
        last_stage_modules=sharding.LAST_STAGE,
    )
    assert last.output is not None and last.tok_embeddings is None


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_a_zero_bubble_schedule_over_four_ranks_trains_the_model_of_one_process(
    tiny_corpus, tmp_path, schedule
):
    """8 stages in a V over 4 ranks (rank 0 holds stages 0 and 7, and so the embedding and the output
    layer, which share their weight), 8 micro-batches: every step's loss and gradient norm, the validation
    loss, and the checkpoint resumed on one process match one process."""
    row = config_space.default_row() | {
        "model.tie_embeddings": True,
        "parallel.pp": 4,
        "parallel.pp_virtual_stages": 2,
        "parallel.pp_schedule": schedule,
        "parallel.zero_stage": 2,
        "training.micro_batch_size": 1,
    }
    result = Matrix(tiny_corpus, tmp_path, steps=4).run(0, row)
    assert result.status == "matched", result.message
    assert result.loss < 1e-5 and result.resumed < 1e-5


def test_equal_layers_split_as_the_programme_would_split_them():
    """Equal weights without extras take a closed form (the planner splits thousands of layouts); it is the
    dynamic programme's answer, which near-equal weights still go through."""
    for layers in range(1, 40):
        for stages in range(1, layers + 1):
            nudged = [1.0] * (layers - 1) + [1.0 + 1e-9]  # not all equal: the programme
            assert [len(r) for r in split_layers([1] * layers, stages)] == [
                len(r) for r in split_layers(nudged, stages)
            ], (layers, stages)
