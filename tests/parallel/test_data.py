"""FSDP2 (ZeRO-2 / ZeRO-3), HSDP and FSDP x TP against one process: loss and gradients of a full batch."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from megascale.models import sharding
from megascale.models.llama import Transformer
from megascale.parallel.data import apply_fsdp
from megascale.parallel.data_overlap import issue_first_all_gathers
from megascale.parallel.tensor import apply_tensor_parallel, loss_context
from tests.parallel.multiprocess import run_ranks
from tests.parallel.tiny import tiny_model_config

BATCH = 4


def _errors(rank, world_size, mesh_shape, mesh_names, zero_stage, block):
    """(|mean loss - reference|, max |grad - reference grad|) for one layout."""
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=mesh_names)
    cfg = tiny_model_config(block)
    torch.manual_seed(0)
    reference = Transformer(cfg)
    sharded = copy.deepcopy(reference)
    tp = "tp" in mesh_names
    if tp:
        apply_tensor_parallel(
            sharded,
            mesh["tp"],
            blocks=sharding.BLOCKS,
            block_plan=sharding.BLOCK_PLAN,
            top_level_plan=sharding.TOP_LEVEL_PLAN,
            sequence_parallel=True,
        )
    dp_names = tuple(name for name in mesh_names if name != "tp")
    apply_fsdp(sharded, mesh[dp_names], blocks=sharding.BLOCKS, zero_stage=zero_stage)

    tokens = torch.randint(0, 96, (BATCH, 33), generator=torch.Generator().manual_seed(1))
    ref_loss = F.cross_entropy(reference(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    ref_loss.backward()
    dp_mesh = mesh[dp_names]._flatten("dp") if len(dp_names) > 1 else mesh[dp_names[0]]
    dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
    local = tokens.chunk(dp_size)[dp_rank]
    logits = sharded(local[:, :-1])
    with loss_context(tp):
        loss = F.cross_entropy(logits.flatten(0, 1), local[:, 1:].flatten())
        loss.backward()
    loss = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
    dist.all_reduce(loss, group=dp_mesh.get_group())
    grad_error = max(
        ((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) - ref.grad).abs().max().item()
        for ref, p in zip(reference.parameters(), sharded.parameters())
    )
    return (loss / dp_size - ref_loss).abs().item(), grad_error


@pytest.mark.parametrize(
    "world_size, mesh_shape, mesh_names, zero_stage, block",
    [
        (2, (2,), ("dp_shard",), 3, "serial"),
        (2, (2,), ("dp_shard",), 2, "parallel"),
        (4, (2, 2), ("dp_replicate", "dp_shard"), 3, "serial"),
        (4, (2, 2), ("dp_shard", "tp"), 3, "parallel"),
    ],
)
def test_fsdp_layouts_match_single_process(world_size, mesh_shape, mesh_names, zero_stage, block):
    loss_error, grad_error = run_ranks(_errors, world_size, mesh_shape, mesh_names, zero_stage, block)[0]
    print(
        f"{mesh_names} {mesh_shape} zero{zero_stage} {block}: |delta loss| {loss_error:.2e}, "
        f"max |delta grad| {grad_error:.2e}"
    )
    assert loss_error <= 1e-5 and grad_error <= 1e-5


def _train_with_overlap(rank, world_size, overlap, directory):
    """Three optimizer steps of FSDP (ZeRO-3) with the DP overlap on or off: the losses, and the names of
    what the training thread waited in (a blocking all-gather, or the wait for one issued ahead)."""
    from megascale.observe.collectives import record_collectives
    from megascale.observe.timeline import WAIT, Timeline
    from megascale.observe.trace import read_trace

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    torch.manual_seed(0)
    model = Transformer(tiny_model_config("serial"))
    apply_fsdp(model, mesh, blocks=sharding.BLOCKS, zero_stage=3, overlap=overlap)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    timeline = Timeline(directory, rank=rank, coords={})
    record_collectives(timeline)
    losses = []
    for step in range(3):
        if overlap:
            issue_first_all_gathers([model])
        tokens = torch.randint(0, 96, (2, 33), generator=torch.Generator().manual_seed(10 * step + rank))
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    record_collectives(None)
    timeline.close()
    events = read_trace(directory / f"rank-{rank:05d}.json")
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    waits = [e["name"] for e in events if e["ph"] == "X" and tracks[e["tid"]] == WAIT]
    return losses, waits


def test_dp_overlap_issues_every_all_gather_ahead_and_changes_no_bit(tmp_path):
    (plain, plain_waits), _ = run_ranks(_train_with_overlap, 2, False, tmp_path / "off")
    (overlapped, overlapped_waits), _ = run_ranks(_train_with_overlap, 2, True, tmp_path / "on")
    assert overlapped == plain  # the same all-gathers, only issued earlier
    assert plain_waits.count("all_gather_single") > 0 and "wait all_gather_single" not in plain_waits
    # Overlapped: no all-gather blocks where it is issued; the training thread only waits for ones in flight.
    assert "all_gather_single" not in overlapped_waits
    assert overlapped_waits.count("wait all_gather_single") == plain_waits.count("all_gather_single")
