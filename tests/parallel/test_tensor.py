"""Tensor + sequence parallelism against the same model on one process: loss and every gradient."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from megascale.models import sharding
from megascale.models.llama import Transformer
from megascale.parallel.activation import apply_activation_checkpointing
from megascale.parallel.tensor import apply_tensor_parallel, loss_context
from tests.parallel.multiprocess import run_ranks
from tests.parallel.tiny import tiny_model_config

CASES = [
    dict(block="serial", window=None, sequence_parallel=True),
    dict(block="serial", window=None, sequence_parallel=False),
    dict(block="parallel", window=None, sequence_parallel=True),
    dict(block="serial", window=8, sequence_parallel=True),
    dict(block="parallel", window=8, sequence_parallel=False),
    dict(
        block="serial", window=None, sequence_parallel=True, position="learned", norm="layernorm", mlp="gelu"
    ),
    # The TP overlap (parallel.overlap.tp): the sequence in chunks, uneven ones too (16 rows in 3).
    dict(block="serial", window=None, sequence_parallel=True, overlap_chunks=3),
    dict(block="parallel", window=None, sequence_parallel=True, overlap_chunks=2),
    dict(block="serial", window=None, sequence_parallel=True, mlp="gelu", overlap_chunks=2),
    dict(block="serial", window=8, sequence_parallel=True, overlap_chunks=3),  # and the attention's
    dict(block="serial", window=None, sequence_parallel=True, position="learned", overlap_chunks=2),
    # Tied embeddings stay one parameter (TP shards both modules' copy alike, then ties them again).
    dict(block="serial", window=None, sequence_parallel=True, tie_embeddings=True),
    dict(block="parallel", window=None, sequence_parallel=False, tie_embeddings=True, overlap_chunks=2),
    # Activation checkpointing around the overlap's autograd functions, which read their saved tensors once.
    dict(block="serial", window=None, sequence_parallel=True, overlap_chunks=2, checkpoint="full"),
    dict(block="parallel", window=8, sequence_parallel=True, overlap_chunks=3, checkpoint="selective"),
]


def _max_errors(rank, world_size):
    """Per case: (|loss - reference|, max over parameters of |grad - reference grad|, parameters of the
    sharded model less the reference's, warnings raised)."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    errors = []
    for case in CASES:
        options = {k: v for k, v in case.items() if k in ("position", "norm", "mlp", "tie_embeddings")}
        cfg = tiny_model_config(case["block"], case["window"], **options)
        torch.manual_seed(0)
        reference = Transformer(cfg)
        sharded = copy.deepcopy(reference)
        apply_tensor_parallel(
            sharded,
            mesh,
            blocks=sharding.BLOCKS,
            block_plan=sharding.BLOCK_PLAN,
            top_level_plan=sharding.TOP_LEVEL_PLAN,
            sequence_parallel=case["sequence_parallel"],
            overlap_chunks=case.get("overlap_chunks"),
        )
        apply_activation_checkpointing(sharded, blocks=sharding.BLOCKS, mode=case.get("checkpoint", "none"))
        extra_params = len(list(sharded.parameters())) - len(list(reference.parameters()))
        tokens = torch.randint(0, 96, (3, 33), generator=torch.Generator().manual_seed(1))
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        ref_loss = F.cross_entropy(reference(inputs).flatten(0, 1), labels.flatten())
        ref_loss.backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            logits = sharded(inputs)
            with loss_context(True):
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
                loss.backward()
        loss_value = loss.full_tensor() if isinstance(loss, DTensor) else loss
        grad_error = 0.0
        for (_name, ref_param), param in zip(reference.named_parameters(), sharded.parameters()):
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            grad_error = max(grad_error, (grad - ref_param.grad).abs().max().item())
        said = sorted({str(warning.message).splitlines()[0] for warning in caught})
        errors.append(((loss_value - ref_loss).abs().item(), grad_error, extra_params, said))
    return errors


@pytest.mark.parametrize("world_size", [2])
def test_tp_matches_single_process(world_size):
    per_rank = run_ranks(_max_errors, world_size)
    for case, (loss_error, grad_error, extra_params, said) in zip(CASES, per_rank[0]):
        print(f"tp{world_size} {case}: |delta loss| {loss_error:.2e}, max |delta grad| {grad_error:.2e}")
        assert extra_params == 0, case  # a tied weight untied by sharding would be one more
        assert loss_error <= 1e-5 and grad_error <= 1e-5, case
        assert not [text for text in said if "deprecated" in text], (case, said)  # torch's, to the user
