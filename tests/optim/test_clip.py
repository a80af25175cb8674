"""Global-norm clipping over gradients of every kind a sharded model holds at once, against the norm of the
whole gradients on one process."""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from megascale.optim.clip import clip_by_global_norm
from tests.parallel.multiprocess import run_ranks

MAX_NORM = 0.5


def _whole_gradients() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) for shape in ((8, 4), (6,), (4, 8), (8,))]


def _clip_mixed(rank, world_size):
    """dp 2 x tp 2, as FSDP x TP without sequence parallelism leaves a model: a weight sharded over both
    meshes' dimensions, a norm sharded by FSDP alone (the 1-D data-parallel mesh), a weight sharded by TP
    alone, and a plain replicated tensor. Returns the norm and the clipped gradients, whole."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    whole = _whole_gradients()
    sharded = [
        distribute_tensor(whole[0], mesh, [Shard(0), Shard(1)]),
        distribute_tensor(whole[1], mesh["dp"], [Shard(0)]),
        distribute_tensor(whole[2], mesh["tp"], [Shard(1)]),
        whole[3].clone(),
    ]
    params = []
    for grad in sharded:
        param = torch.nn.Parameter(torch.zeros_like(grad))
        param.grad = grad
        params.append(param)
    norm = clip_by_global_norm(params, MAX_NORM)
    clipped = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in params]
    return float(norm), [grad.tolist() for grad in clipped]


def test_the_global_norm_of_gradients_on_two_meshes_and_plain_ones_is_the_whole_models():
    whole = _whole_gradients()
    expected = torch.linalg.vector_norm(torch.cat([grad.flatten() for grad in whole]))
    for norm, clipped in run_ranks(_clip_mixed, 4):
        assert abs(norm - expected.item()) <= 1e-6 * expected.item()
        scale = MAX_NORM / (expected.item() + 1e-6)
        for got, grad in zip(clipped, whole):
            torch.testing.assert_close(torch.tensor(got), grad * scale)


def _log_of_a_norm_over_two_mesh_dimensions(rank, world_size):
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("torch.distributed.tensor").addHandler(handler)
    _clip_mixed(rank, world_size)
    return [record.getMessage() for record in records]


def test_the_norm_over_two_mesh_dimensions_logs_nothing():
    """DTensor's hint that a 2-D norm takes two all-reduces would be printed by every rank of an FSDP x TP
    run; clipping drops it."""
    assert run_ranks(_log_of_a_norm_over_two_mesh_dimensions, 4) == [[]] * 4
