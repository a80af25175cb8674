"""The parity matrix's every-pair set in the suite: each accepted combination trains the model of one process
(losses, gradient norms, validation; and for each layout, its checkpoint resumed on one process and
exported to Hugging Face), and each refused one is refused by `megascale train` in one line, before any
process starts. The runner and what it compares are in tests/parallel/parity_matrix.py;
`python -m tests.parallel.parity_matrix` writes the same set's table (docs/parity/pairs.md)."""

import pytest

from megascale.cli import main
from tests.parallel import config_space
from tests.parallel.parity_matrix import BASE, Matrix, arguments, covering, describe, micro_batch_rows

COVER = covering(2)
MICRO_BATCHES = micro_batch_rows()
# Each row for 4 steps here (its checkpoint at 2, resumed for steps 3 and 4), against the table's 10: a
# layout that breaks parity does so from its first steps (a gradient at step 1, the optimizer's state from
# step 2), and the rows are the suite's largest share of its time.
SUITE_STEPS = 4


@pytest.fixture(scope="module")
def matrix(tiny_corpus, tmp_path_factory):
    return Matrix(tiny_corpus, tmp_path_factory.mktemp("matrix"), steps=SUITE_STEPS)


@pytest.mark.slow
@pytest.mark.xdist_group("parity_matrix")  # one worker runs the rows: each reference trained once
@pytest.mark.parametrize(
    "index",
    range(len(COVER.accepted)),
    ids=[f"{i}-{config_space.world_size(row)}proc" for i, row in enumerate(COVER.accepted)],
)
def test_a_combination_trains_the_model_of_one_process(matrix, index):
    row = COVER.accepted[index]
    result = matrix.run(index, row)
    print(
        f"{describe(row)}: {result.status}; loss {result.loss:.1e}, grad norm {result.grad_norm:.1e}, "
        f"val loss {result.val_loss:.1e}, resumed {result.resumed:.1e}, export {result.export}"
    )
    assert result.status == "matched", result.message


@pytest.mark.slow
@pytest.mark.xdist_group("parity_matrix")
@pytest.mark.parametrize("row", MICRO_BATCHES, ids=[describe(row) for row in MICRO_BATCHES])
def test_the_micro_batch_alone_does_not_change_the_model_of_one_process(matrix, row):
    result = matrix.run(len(COVER.accepted) + MICRO_BATCHES.index(row), row)
    print(f"{describe(row)}: loss {result.loss:.1e}, grad {result.grad_norm:.1e}, val {result.val_loss:.1e}")
    assert result.status == "matched", result.message


@pytest.mark.parametrize("index", range(len(COVER.refused)))
def test_a_combination_megascale_cannot_support_is_refused_before_any_process_starts(index, capsys):
    pair, row, reason = COVER.refused[index]
    processes = config_space.world_size(row)
    assert main(["train", "--nproc", str(processes), *BASE, *arguments(row)]) == 2
    said = capsys.readouterr().err.strip()
    assert said == f"error: {reason}", pair
    # One line, naming a knob of the pair or one the pair needs set (an MoE model for the MoE knobs).
    named = {key for key, _ in pair}.union(*(config_space.prerequisites(key) for key, _ in pair))
    assert "\n" not in said and any(key in said for key in named)
