"""LAMB against an independent float64 NumPy reference written with plain loops, plus resume and checks."""

import io
import math

import numpy as np
import pytest
import torch

from megascale.optim.lamb import Lamb

LR, BETAS, EPS, WEIGHT_DECAY, TRUST_CLAMP, STEPS = 0.05, (0.9, 0.99), 1e-8, 0.1, 2.0, 6


def make_problem() -> tuple[list[list[np.ndarray]], list[np.ndarray], list[float]]:
    """Per-tensor weights, per-step gradients and weight decays covering every trust-ratio branch."""
    rng = np.random.default_rng(0)
    weights = [
        rng.normal(size=(3, 4)),  # decayed, trust below the clamp
        10.0 * rng.normal(size=(2, 5)),  # decayed, trust above the clamp (clamped)
        np.zeros((4, 2)),  # ||w|| = 0 on the first step
        rng.normal(size=(6,)),  # zero gradient and no decay: ||u|| = 0
        rng.normal(size=(5,)),  # no decay, ordinary gradient
    ]
    decays = [WEIGHT_DECAY, WEIGHT_DECAY, WEIGHT_DECAY, 0.0, 0.0]
    grads = [[rng.normal(size=w.shape) for w in weights] for _ in range(STEPS)]
    for step_grads in grads:
        step_grads[3] = np.zeros_like(weights[3])
    return grads, weights, decays


def reference_lamb(weights, grads, decays, trust_clamp) -> tuple[list[list[float]], int]:
    """LAMB in float64 with scalar loops; also returns how often the clamp bound."""
    params = [list(w.ravel()) for w in weights]
    exp_avgs = [[0.0] * len(p) for p in params]
    exp_avg_sqs = [[0.0] * len(p) for p in params]
    times_clamped = 0
    for step, step_grads in enumerate(grads, start=1):
        for i, param in enumerate(params):
            grad = list(step_grads[i].ravel())
            update = []
            for j in range(len(param)):
                exp_avgs[i][j] = BETAS[0] * exp_avgs[i][j] + (1 - BETAS[0]) * grad[j]
                exp_avg_sqs[i][j] = BETAS[1] * exp_avg_sqs[i][j] + (1 - BETAS[1]) * grad[j] ** 2
                m_hat = exp_avgs[i][j] / (1 - BETAS[0] ** step)
                v_hat = exp_avg_sqs[i][j] / (1 - BETAS[1] ** step)
                update.append(m_hat / (math.sqrt(v_hat) + EPS) + decays[i] * param[j])
            weight_norm = math.sqrt(sum(x * x for x in param))
            update_norm = math.sqrt(sum(x * x for x in update))
            trust = weight_norm / update_norm if weight_norm > 0 and update_norm > 0 else 1.0
            if trust_clamp is not None and trust > trust_clamp:
                trust, times_clamped = trust_clamp, times_clamped + 1
            for j in range(len(param)):
                param[j] -= LR * trust * update[j]
    return params, times_clamped


def run_lamb(weights, grads, decays, trust_clamp, dtype) -> list[torch.Tensor]:
    params = [torch.tensor(w, dtype=dtype, requires_grad=True) for w in weights]
    groups = [{"params": [p], "weight_decay": d} for p, d in zip(params, decays)]
    optimizer = Lamb(groups, lr=LR, betas=BETAS, eps=EPS, trust_clamp=trust_clamp)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = torch.tensor(g, dtype=dtype)
        optimizer.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("trust_clamp", [None, TRUST_CLAMP])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-6), (torch.float32, 1e-4)])
def test_matches_reference(trust_clamp, dtype, tolerance):
    grads, weights, decays = make_problem()
    expected, times_clamped = reference_lamb(weights, grads, decays, trust_clamp)
    assert times_clamped > 0 or trust_clamp is None
    actual = run_lamb(weights, grads, decays, trust_clamp, dtype)
    for got, want in zip(actual, expected):
        assert np.abs(got.double().numpy().ravel() - np.array(want)).max() <= tolerance
    assert torch.equal(actual[3], torch.tensor(weights[3], dtype=dtype))  # ||u|| = 0: left as it was
    assert actual[2].abs().sum() > 0  # ||w|| = 0: moved with trust 1


def test_resume_is_bit_exact():
    grads, weights, decays = make_problem()
    params = [torch.tensor(w, dtype=torch.float32, requires_grad=True) for w in weights]

    def make(tensors):
        groups = [{"params": [p], "weight_decay": d} for p, d in zip(tensors, decays)]
        return Lamb(groups, lr=LR, betas=BETAS, eps=EPS, trust_clamp=TRUST_CLAMP)

    def train(optimizer, tensors, step_grads_list):
        for step_grads in step_grads_list:
            for p, g in zip(tensors, step_grads):
                p.grad = torch.tensor(g, dtype=torch.float32)
            optimizer.step()

    optimizer = make(params)
    train(optimizer, params, grads[:3])
    buffer = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in params], "optim": optimizer.state_dict()}, buffer)
    train(optimizer, params, grads[3:])

    buffer.seek(0)
    saved = torch.load(buffer)
    resumed_params = [p.requires_grad_() for p in saved["params"]]
    resumed = make(resumed_params)
    resumed.load_state_dict(saved["optim"])
    train(resumed, resumed_params, grads[3:])
    for uninterrupted, restarted in zip(params, resumed_params):
        assert torch.equal(uninterrupted, restarted)
    assert set(resumed.state[resumed_params[0]]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"lr": -1.0}, "lr"),
        ({"betas": (1.0, 0.9)}, r"betas\[0\]"),
        ({"betas": (0.9, -0.1)}, r"betas\[1\]"),
        ({"eps": 0.0}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"trust_clamp": 0.0}, "trust_clamp"),
    ],
)
def test_rejects_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Lamb([torch.zeros(2, requires_grad=True)], **kwargs)


def _norms_of_mixed_shards(rank, world_size):
    """dp 2 x tp 2: the tensors of test_clip's mixed model (sharded over both dimensions, over one mesh's,
    over the other's, plain), others, and one FSDP2 sharded after TP on the same dimension (_StridedShard),
    twice. Returns their norms and how many all-reduces gave them."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from megascale.optim.lamb import global_norms

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    whole = _whole_tensors()
    tensors = [
        distribute_tensor(whole[0], mesh, [Shard(0), Shard(1)]),
        distribute_tensor(whole[1], mesh["dp"], [Shard(0)]),
        distribute_tensor(whole[2], mesh["tp"], [Shard(1)]),
        whole[3].clone(),
        distribute_tensor(whole[4], mesh, [Shard(0), Replicate()]),  # uneven: 5 rows over 2 ranks
        distribute_tensor(whole[5], mesh, [Shard(1), Shard(0)]),
        _fsdp_over_tp(whole[6], mesh),
    ]
    calls = []
    all_reduce = dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: calls.append(1) or all_reduce(*args, **kwargs)
    try:
        norms = global_norms(tensors + tensors)
    finally:
        dist.all_reduce = all_reduce
    return norms.tolist(), len(calls)


def _fsdp_over_tp(whole: torch.Tensor, mesh) -> torch.Tensor:
    """`whole` as the weight of a column-parallel Linear that FSDP2 then shards over "dp"."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    linear = torch.nn.Linear(whole.shape[1], whole.shape[0], bias=False)
    linear.weight.data.copy_(whole)
    parallelize_module(linear, mesh["tp"], ColwiseParallel())
    fully_shard(linear, mesh=mesh["dp"])
    return linear.weight.data


def _whole_tensors() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = ((8, 4), (6,), (4, 8), (8,), (5, 3), (4, 6), (8, 4))
    return [torch.randn(shape, generator=generator) for shape in shapes]


def test_global_norms_of_sharded_tensors_are_the_whole_tensors_norms_in_few_all_reduces():
    """Each DTensor's norm over all its shards, as torch.linalg.vector_norm of the whole tensor gives it
    on one process; one all-reduce per mesh dimension of each sharding pattern (here 2 + 1 + 1 + 1),
    however many tensors share it (before, two per tensor and step)."""
    from tests.parallel.multiprocess import run_ranks

    want = [float(torch.linalg.vector_norm(t)) for t in _whole_tensors()] * 2
    for norms, calls in run_ranks(_norms_of_mixed_shards, 4, timeout_s=60):
        assert norms == pytest.approx(want, rel=1e-6)
        assert calls == 5
