"""Sharding really divides the memory: per-rank bytes of optimizer state under dp_shard = 4 and of
parameters under tp = 2, against one process (sums of the local shards each rank holds)."""

import torch

from megascale.config import load_config
from megascale.trainer import Trainer
from tests.conftest import TINY
from tests.parallel.multiprocess import run_ranks


def local_bytes(tensors) -> int:
    """Bytes this rank holds for `tensors`: a DTensor's local shard, a plain tensor whole."""
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def measure(rank, world_size, corpus, data_dir, run_dir, layout):
    args = [
        *TINY,
        "--model.dim=64",
        "--training.global_batch_size=4",
        "--training.micro_batch_size=1",
        f"--data.source={corpus}",
        f"--data.cache_dir={data_dir}",
        f"--training.run_dir={run_dir}",
        *layout,
    ]
    trainer = Trainer(load_config(None, args))
    trainer.train_step()  # creates the optimizer state
    params = [p for part in trainer.model.parts for p in part.parameters()]
    state = [
        value
        for optimizer in trainer.optimizers
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    ]
    return local_bytes(params), local_bytes(state)


def test_dp_shard_4_divides_optimizer_state_and_tp_2_divides_parameters(tiny_corpus, tmp_path):
    data = tmp_path / "data"
    params_1, state_1 = run_ranks(measure, 1, tiny_corpus, data, tmp_path / "one", [])[0]
    fsdp = run_ranks(measure, 4, tiny_corpus, data, tmp_path / "fsdp", ["--parallel.dp_shard=4"])
    tp = run_ranks(measure, 2, tiny_corpus, data, tmp_path / "tp", ["--parallel.tp=2"])
    state_ratio = max(state for _, state in fsdp) / state_1
    param_ratio = max(params for params, _ in tp) / params_1
    print(f"optimizer state per rank, dp_shard=4 vs 1 process: {state_ratio:.3f}x ({state_1:,} bytes at 1)")
    print(f"parameters per rank, tp=2 vs 1 process: {param_ratio:.3f}x ({params_1:,} bytes at 1)")
    assert state_ratio <= 0.3
    assert param_ratio <= 0.55
