"""Memory per device against a hand count for a small model, and how ZeRO stages and recomputation move it."""

import dataclasses

import pytest

from megascale.plan.job import (
    FP32_WEIGHTS,
    FP32_WEIGHTS_BF16_GATHERS,
    MIXED_BF16,
    Features,
    Job,
    Layout,
)
from megascale.plan.memory import activation_bytes_per_block, memory_per_device, stage_params
from megascale.plan.systems import TRAINER
from tests.parallel.tiny import tiny_model_config
from tests.plan.paper import MODEL_175B

# tiny: dim 64, 2 layers, vocabulary 96, 4 query / 2 key-value heads (head size 16), SwiGLU width 192.
# One block: q and o 64x64 each, k and v 64x32 each = 12,288; MLP 3 x 64 x 192 = 36,864; two norms 128.
BLOCK = 12_288 + 36_864 + 128
EMBEDDINGS = 2 * 96 * 64  # input embedding and output layer, untied
JOB = Job(tiny_model_config(), seq_len=32, global_batch=8, dtype="float32", precision=FP32_WEIGHTS)
# What one tiny block keeps per token, counted by hand at 2-byte activations (no dropout): two norms'
# inputs and the two inputs of the column-parallel layers (4 x 2 x 64), queries and keys (2 x (64 + 32)),
# values (2 x 32), the attention's output (2 x 64), SwiGLU's gate, up and product (3 x 2 x 192).
KEPT_PER_TOKEN = 4 * 2 * 64 + 2 * (64 + 32) + 2 * 32 + 2 * 64 + 3 * 2 * 192
# Systems that keep tensors otherwise than the default one does (`Features`).
EAGER = Features(elementwise="eager")  # torch's eager SwiGLU: SiLU's output kept too
FLOAT8_INPUTS = Features(float8_keeps_inputs=True)  # Transformer Engine's float8 copies of the inputs
MATERIALIZED = Features(attention_kernel="materialized")  # attention's scores materialised
AS_MADE = Features(grads_as_made=True)  # gradients made by the backward, not held in a buffer


def test_parameters_of_the_heaviest_stage():
    assert stage_params(JOB, Layout()) == 2 * BLOCK + EMBEDDINGS
    assert stage_params(JOB, Layout(pp=2)) == BLOCK + 96 * 64  # one block and one of the two embeddings
    assert stage_params(JOB, Layout(tp=2)) == (2 * BLOCK + EMBEDDINGS) / 2


def test_training_state_by_zero_stage_matches_a_hand_count():
    params = 2 * BLOCK + EMBEDDINGS
    # fp32 weights (4 bytes), fp32 gradients (4), Adam moments (8); dp 2.
    expected = {
        1: (4 * params, 4 * params, 8 * params / 2),
        2: (4 * params, 4 * params / 2, 8 * params / 2),
        3: (4 * params / 2, 4 * params / 2, 8 * params / 2),
    }
    for stage, (weights, grads, optimizer) in expected.items():
        memory = memory_per_device(JOB, Layout(dp=2, micro_batch=2, zero_stage=stage))
        assert (memory.weights_bytes, memory.grads_bytes, memory.optimizer_bytes) == (
            weights,
            grads,
            optimizer,
        )


def test_bfloat16_gathers_hold_sharded_masters_and_the_gathered_copies():
    """megascale's FSDP under bfloat16: float32 masters sharded at every stage; below ZeRO-3 the blocks'
    bfloat16 copies stay gathered (2 bytes), the embedding and output layer in float32 (4)."""
    job = dataclasses.replace(JOB, dtype="bfloat16", precision=FP32_WEIGHTS_BF16_GATHERS)
    params = 2 * BLOCK + EMBEDDINGS
    gathered = 2 * 2 * BLOCK + 4 * EMBEDDINGS
    expected = {1: 4 * params / 2 + gathered, 2: 4 * params / 2 + gathered, 3: 4 * params / 2}
    for stage, weights in expected.items():
        assert memory_per_device(job, Layout(dp=2, micro_batch=2, zero_stage=stage)).weights_bytes == weights
    assert memory_per_device(job, Layout(micro_batch=2)).weights_bytes == 4 * params  # no data parallelism


def test_a_gpt_block_keeps_korthikantis_34_sbh():
    """Korthikanti et al.'s Eq. 1-2 for a GPT block (multi-head attention, a 4h GeLU MLP, dropout):
    34 sbh at 2-byte activations, 10 sbh of it kept whole on every tp rank without sequence parallelism."""
    s, b, h = 2048, 1, MODEL_175B.dim
    job = Job(MODEL_175B, s, 8, dropout=True)
    layout = Layout(micro_batch=b, recompute="none")
    assert activation_bytes_per_block(job, layout) == s * b * h * 34
    tp = dataclasses.replace(layout, tp=8)
    assert activation_bytes_per_block(job, tp) == s * b * h * 34 / 8  # sequence parallel: all of it / t
    no_sp = dataclasses.replace(tp, sequence_parallel=False)
    assert activation_bytes_per_block(job, no_sp) == s * b * h * (10 + 24 / 8)
    no_dropout = dataclasses.replace(job, dropout=False)  # two 1-byte masks fewer
    assert activation_bytes_per_block(no_dropout, layout) == s * b * h * 32


def test_activations_follow_the_blocks_tensors_and_shrink_with_recomputation():
    s, b, h = 32, 2, 64
    layout = Layout(micro_batch=b, recompute="none")
    # Grouped-query attention and SwiGLU counted tensor by tensor; fp32 doubles the 2-byte count.
    assert activation_bytes_per_block(JOB, layout) == s * b * KEPT_PER_TOKEN * 2
    full = dataclasses.replace(layout, recompute="full")
    assert activation_bytes_per_block(JOB, full) == s * b * h * 2 * 2  # only the block's input
    tp = dataclasses.replace(layout, tp=2)
    assert activation_bytes_per_block(JOB, tp) == s * b * KEPT_PER_TOKEN * 2 / 2  # sequence parallel
    no_sp = dataclasses.replace(tp, sequence_parallel=False)
    whole_on_each = 4 * 2 * h  # norms' and column-parallel layers' inputs, whole on each tp rank
    assert (
        activation_bytes_per_block(JOB, no_sp)
        == s * b * (whole_on_each + (KEPT_PER_TOKEN - whole_on_each) / 2) * 2
    )
    eager = activation_bytes_per_block(JOB, layout, features=EAGER)  # SiLU's output kept too
    assert eager - activation_bytes_per_block(JOB, layout) == s * b * 2 * 192 * 2
    memory = memory_per_device(JOB, layout)
    logits = 2 * 4 * b * s * 96
    assert memory.activations_bytes == 2 * s * b * KEPT_PER_TOKEN * 2 + logits
    fused_loss = memory_per_device(JOB, layout, Features(loss_bytes_per_logit=4))  # bfloat16 logits, gradient
    assert memory.activations_bytes - fused_loss.activations_bytes == logits / 2


def test_transformer_engines_float8_layers_keep_their_inputs_in_float8():
    """Transformer Engine's float8 linear layers keep the inputs they read at a byte an element: the two
    norms' outputs and SwiGLU's product in float8 alone; the attention's output in bfloat16 for the
    attention's backward and in float8 for the output projection's. torchao's keep bfloat16 ones."""
    s, b, h, q, ffn = 32, 2, 64, 64, 192
    layout = Layout(micro_batch=b, recompute="none")
    job = dataclasses.replace(JOB, dtype="bfloat16", precision=MIXED_BF16, fp8=True)
    bf16_inputs = activation_bytes_per_block(job, layout)
    assert bf16_inputs == s * b * KEPT_PER_TOKEN  # torchao's: as in bfloat16
    float8_inputs = activation_bytes_per_block(job, layout, features=FLOAT8_INPUTS)
    assert bf16_inputs - float8_inputs == s * b * (2 * h + ffn - q)
    no_fp8 = activation_bytes_per_block(JOB, layout, features=FLOAT8_INPUTS)
    assert no_fp8 == s * b * KEPT_PER_TOKEN * 2  # a job without float8 keeps its bfloat16 inputs
    memory = memory_per_device(job, layout, FLOAT8_INPUTS)
    assert memory_per_device(job, layout).activations_bytes - memory.activations_bytes == 2 * s * b * (
        2 * h + ffn - q
    )


def test_the_first_stage_holds_pp_micro_batches_more_when_interleaved():
    job = dataclasses.replace(JOB, model=tiny_model_config(n_layers=4), precision=MIXED_BF16, global_batch=16)
    one_f_one_b = memory_per_device(job, Layout(pp=2, micro_batch=1))
    interleaved = memory_per_device(job, Layout(pp=2, micro_batch=1, virtual_stages=2))
    per_stage = 2 * activation_bytes_per_block(job, Layout(pp=2, micro_batch=1))
    logits = 2 * 4 * 32 * 96
    assert one_f_one_b.activations_bytes == pytest.approx(2 * per_stage + logits)
    assert interleaved.activations_bytes == pytest.approx(2 * (1 + 1 / 4) * per_stage + logits)


def test_materialised_attention_scores_are_kept_unless_recomputed():
    """Without a FlashAttention kernel the [heads, s, s] scores stay for the backward: Korthikanti et al.'s
    5 a s^2 b bytes a layer (over t) with dropout (the softmax's output, the mask, the dropped-out scores),
    2 without; selective recomputation drops them."""

    job = Job(MODEL_175B, 2048, 64, dropout=True)
    layout = Layout(tp=8, pp=8, dp=1, recompute="none")
    flash = memory_per_device(job, layout).activations_bytes
    materialized = memory_per_device(job, layout, MATERIALIZED).activations_bytes
    scores_per_layer = 5 * MODEL_175B.attention.n_heads * 2048**2 / 8
    in_flight = 8  # the first stage's micro-batches under 1F1B
    assert materialized - flash == pytest.approx(12 * scores_per_layer * in_flight, rel=1e-6)
    without_dropout = dataclasses.replace(job, dropout=False)
    kept = memory_per_device(without_dropout, layout, MATERIALIZED).activations_bytes
    assert kept - memory_per_device(without_dropout, layout).activations_bytes == pytest.approx(
        12 * scores_per_layer * 2 / 5 * in_flight, rel=1e-6
    )
    selective = dataclasses.replace(layout, recompute="selective")
    assert memory_per_device(job, selective, MATERIALIZED).activations_bytes == pytest.approx(
        memory_per_device(job, selective).activations_bytes
    )


def test_torchtitans_selective_op_checkpointing_keeps_every_other_matmuls_output():
    """'op' keeps the block's input, the attention's output and the outputs of the first, third, ...
    matmul in forward order (q 64, v 32, the MLP's gate 192 and output 64 of the tiny model), 4 bytes each
    here, between none and full recomputation."""
    s, b = 32, 1
    kept = 64 + 4 * 16 + (64 + 32 + 192 + 64)
    assert activation_bytes_per_block(JOB, Layout(recompute="op")) == s * b * kept * 4
    kinds = ("none", "op", "full")
    by_kind = {kind: activation_bytes_per_block(JOB, Layout(recompute=kind)) for kind in kinds}
    assert by_kind["full"] < by_kind["op"] < by_kind["none"]


def _saved_by_first_block(cfg, batch: int) -> int:
    """Bytes the first block of megascale's model saves for its backward, counted by storage as autograd
    saves them (not the parameters or buffers), in the training dtype."""
    import itertools

    import torch

    from megascale.models.llama import Transformer

    torch.manual_seed(0)
    model = Transformer(cfg.model)
    state = {t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}
    saved, inside = {}, [False]
    block = model.layers["0"]
    block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    block.register_forward_hook(lambda *_: inside.__setitem__(0, False))

    def pack(tensor):
        storage = tensor.untyped_storage()
        if inside[0] and storage.data_ptr() not in state:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    tokens = torch.randint(cfg.model.vocab_size, (batch, cfg.data.seq_len))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.training.dtype == "bfloat16")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast:
        model(tokens)
    return sum(saved.values())


@pytest.mark.parametrize(
    "options",
    [
        [],
        ["--training.dtype=bfloat16"],
        ["--model.mlp=gelu", "--model.norm=layernorm", "--model.position=learned"],
        ["--model.block=parallel", "--training.dtype=bfloat16", "--model.attention.n_kv_heads=2"],
        ["--model.mlp=gelu", "--training.dtype=bfloat16", "--training.micro_batch_size=4"],
        ["--parallel.activation_checkpoint=full"],
    ],
)
def test_the_trainers_block_is_counted_as_its_model_saves_it(options):
    from megascale.config import load_config
    from megascale.plan.job import job_from_config, layout_from_config
    from megascale.plan.memory import trainer_block_bytes

    cfg = load_config(
        None, ["--model.dim=64", "--data.seq_len=32", "--training.micro_batch_size=2", *options]
    )
    expected = trainer_block_bytes(job_from_config(cfg), layout_from_config(cfg, 1), on_cpu=True)
    if cfg.parallel.activation_checkpoint == "full":  # the block's input alone
        assert expected == cfg.training.micro_batch_size * 32 * 64 * 4
    else:
        assert _saved_by_first_block(cfg, cfg.training.micro_batch_size) == expected


def test_offload_leaves_the_blocks_each_micro_batch_in_flight_keeps():
    """Offload keeps each chunk's last block per micro-batch in flight, and on an accelerator the block
    fetched ahead of the one in its backward."""
    from megascale.plan.memory import offload_held_blocks

    job = dataclasses.replace(JOB, model=tiny_model_config(n_layers=8), global_batch=16)
    logits = 2 * 4 * 32 * 96
    block = activation_bytes_per_block(job, Layout())
    on_cpu = memory_per_device(job, Layout(offload=True), on_cpu=True).activations_bytes
    assert on_cpu == pytest.approx(block + logits)
    assert memory_per_device(job, Layout(offload=True)).activations_bytes == pytest.approx(2 * block + logits)
    pipelined = memory_per_device(job, Layout(pp=2, offload=True)).activations_bytes
    assert pipelined == pytest.approx((2 + 1) * block + logits)  # 1F1B's 2 micro-batches in flight
    assert offload_held_blocks(Layout(virtual_stages=2), blocks=4, in_flight=2, fetch_ahead=True) == 4
    assert offload_held_blocks(Layout(), blocks=2, in_flight=1, fetch_ahead=True) == 1  # nothing to fetch


def test_full_recomputation_holds_every_blocks_input_and_the_recomputed_block_whole():
    """Under full recomputation a block keeps only its input, but the block in its backward recomputes
    its forward and holds all of that until its gradients are done: the offload benchmark's full-
    checkpoint run of the default model peaked at 111 MiB, about that plus its gradients, not at the
    4 inputs (16 MiB) alone (docs/performance.md, "Activation offload")."""
    s, b, h, layers = 32, 2, 64, 2
    none, full = Layout(micro_batch=b, recompute="none"), Layout(micro_batch=b, recompute="full")
    logits = 2 * 4 * b * s * 96
    whole, kept = s * b * KEPT_PER_TOKEN * 2, s * b * h * 2 * 2
    assert memory_per_device(JOB, none).activations_bytes == layers * whole + logits
    assert memory_per_device(JOB, full).activations_bytes == layers * kept + whole + logits
    from megascale.plan.memory import trainer_block_bytes

    own = memory_per_device(JOB, full, Features(own_blocks=True)).activations_bytes
    assert own == layers * trainer_block_bytes(JOB, full) + trainer_block_bytes(JOB, none) + logits


def test_a_single_micro_batch_peaks_where_held_activations_and_gradients_made_weigh_most():
    """One micro-batch, no pipeline: the gradients appear block by block in the backward as activations
    go. Without checkpointing the peak is at the loss (every block's activations and the logits, no
    gradient yet) or in the last block's backward (every block's activations, the output layer's
    gradients and the last block's), whichever is more; under full checkpointing with offload it is in
    block 0's backward, every gradient made beside one input and the recomputed block, as the offload
    benchmark measured it (bench/offload.py: saving 3.6 MiB measured, 3.56 predicted, where the
    activations alone would say 12)."""
    from megascale.plan.memory import trainer_block_bytes

    job = dataclasses.replace(JOB, global_batch=2)
    s, b, layers = 32, 2, 2
    logits, activations = 2 * 4 * b * s * 96, layers * s * b * KEPT_PER_TOKEN * 2
    plain = memory_per_device(job, Layout(micro_batch=b, recompute="none"), AS_MADE)
    at_loss, in_last_block = activations + logits, activations + 4 * (EMBEDDINGS + BLOCK)
    assert plain.activations_bytes + plain.grads_bytes == max(at_loss, in_last_block)
    full = Layout(micro_batch=b, recompute="full", offload=True)
    peak = memory_per_device(job, full, TRAINER, on_cpu=True)
    whole = trainer_block_bytes(job, dataclasses.replace(full, recompute="none"), on_cpu=True)
    assert peak.activations_bytes == pytest.approx(trainer_block_bytes(job, full) + whole)
    assert peak.grads_bytes == pytest.approx(memory_per_device(JOB, full).grads_bytes)  # all of them


def test_a_gradient_buffer_holds_every_gradient_through_a_single_micro_batch():
    """Megatron-LM's and DeepSpeed's contiguous gradient buffers exist before the backward: a step of one
    micro-batch peaks at its activations plus every gradient, where autograd's would peak lower."""
    job = dataclasses.replace(JOB, global_batch=2)
    layout = Layout(micro_batch=2, recompute="none")
    buffered, made = memory_per_device(job, layout), memory_per_device(job, layout, AS_MADE)
    assert buffered.grads_bytes == 4 * (2 * BLOCK + EMBEDDINGS)
    s, b = 32, 2
    assert buffered.activations_bytes == 2 * s * b * KEPT_PER_TOKEN * 2 + 2 * 4 * b * s * 96  # blocks, logits
    assert buffered.total_bytes > made.total_bytes
