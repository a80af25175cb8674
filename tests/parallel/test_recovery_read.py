"""Recovery read with a broadcast: in dp_replicate=2 x pp=2, one rank of each replica pair reads the
checkpoint and sends it to the other. The resumed run is identical to one where every rank reads, and
storage serves half the bytes."""

import os
import shutil

import pytest

from megascale.config import load_config
from megascale.observe.metrics import read_metrics
from megascale.trainer import Trainer
from tests.conftest import TINY
from tests.parallel.multiprocess import run_ranks

STEPS, SAVE_AT = 8, 4
LAYOUT = ["--parallel.dp_replicate=2", "--parallel.pp=2"]
JOB = [
    *TINY,
    *LAYOUT,
    "--model.n_layers=4",
    "--training.global_batch_size=4",
    "--training.micro_batch_size=1",
    f"--training.steps={STEPS}",
    f"--training.val_every={STEPS}",
    f"--checkpoint.every={SAVE_AT}",
]


def trainer_for(corpus, data_dir, run_dir, *extra) -> Trainer:
    args = [*JOB, f"--data.source={corpus}", f"--data.cache_dir={data_dir}", f"--training.run_dir={run_dir}"]
    return Trainer(load_config(None, [*args, *extra]))


def first_half(rank, world_size, corpus, data_dir, run_dir):
    trainer = trainer_for(corpus, data_dir, run_dir)
    while trainer.step < SAVE_AT:
        trainer.train_step()
        trainer.step += 1
    trainer.save_checkpoint(blocking=True)
    trainer.checkpointer.close()


def second_half(rank, world_size, corpus, data_dir, run_dir, broadcast):
    """Resume by hand (resume=false keeps the trainer from loading on its own), with or without replicas."""
    trainer = trainer_for(corpus, data_dir, run_dir, "--checkpoint.resume=false")
    location = trainer.checkpointer.latest_verified()
    replicas = trainer.parallel_dims.replica_group() if broadcast else None
    trainer.checkpointer.load(location, trainer.checkpoint_state(), replicas=replicas)
    assert trainer.step == SAVE_AT
    trainer.train()
    losses = {record["step"]: record["loss"] for record in read_metrics(run_dir)} if rank == 0 else None
    return trainer.checkpointer.bytes_read, losses


@pytest.mark.slow
def test_one_replica_reads_and_broadcasts_with_identical_results(tiny_corpus, tmp_path):
    data = tmp_path / "data"
    run_ranks(first_half, 4, tiny_corpus, data, tmp_path / "saved")
    outcome = {}
    for broadcast in (False, True):
        run_dir = tmp_path / f"broadcast-{broadcast}"
        shutil.copytree(tmp_path / "saved", run_dir)
        outcome[broadcast] = run_ranks(second_half, 4, tiny_corpus, data, run_dir, broadcast)
    every_rank = [read for read, _ in outcome[False]]
    one_per_pair = [read for read, _ in outcome[True]]
    print(
        f"bytes read from storage per rank: every rank reads {every_rank} (total {sum(every_rank)}); "
        f"one per replica pair {one_per_pair} (total {sum(one_per_pair)}, "
        f"{sum(one_per_pair) / sum(every_rank):.2f}x)"
    )
    assert outcome[True][0][1] == outcome[False][0][1]  # every loss of steps 5-8, bit for bit
    assert sorted(outcome[True][0][1]) == list(range(SAVE_AT + 1, STEPS + 1))
    assert all(read > 0 for read in every_rank)
    # Exactly one rank of each replica pair read, as much as it reads alone; its partner read nothing.
    assert sorted(read for read in one_per_pair if read > 0) == sorted(
        every_rank[rank] for rank, read in enumerate(one_per_pair) if read > 0
    )
    assert one_per_pair.count(0) == 2 and sum(one_per_pair) * 2 == sum(every_rank)


def crash_after_stage_one(rank, world_size, corpus, data_dir, run_dir):
    trainer = trainer_for(corpus, data_dir, run_dir, *FSDP4)
    while trainer.step < SAVE_AT:
        trainer.train_step()
        trainer.step += 1
    trainer.checkpointer._in_background = lambda *args: None  # every rank dies before serialising
    trainer.save_checkpoint(blocking=True)


def restarted_step(rank, world_size, corpus, data_dir, run_dir):
    return trainer_for(corpus, data_dir, run_dir, *FSDP4).step


FSDP4 = ["--parallel.dp_replicate=1", "--parallel.dp_shard=4", "--parallel.pp=1"]


def test_a_snapshot_only_in_memory_is_recovered_by_the_restarted_ranks(tiny_corpus, tmp_path):
    # The forked ranks inherit the test's MEGASCALE_STAGING_DIR (conftest), so they share one node's memory.
    data = tmp_path / "data"
    run_ranks(crash_after_stage_one, 4, tiny_corpus, data, tmp_path / "run")
    assert run_ranks(restarted_step, 4, tiny_corpus, data, tmp_path / "run") == [SAVE_AT] * 4


SNAPSHOTS = ["--checkpoint.every=100", "--checkpoint.snapshot_every=2"]


def killed_between_snapshots(rank, world_size, corpus, data_dir, run_dir):
    """Every rank snapshots step 2; rank 3 dies after step 4's last collective, before its snapshot."""
    trainer = trainer_for(corpus, data_dir, run_dir, *FSDP4, *SNAPSHOTS)
    while trainer.step < 4:
        trainer.train_step()
        trainer.step += 1
        if trainer.step == 2 or (trainer.step == 4 and rank != 3):
            trainer.snapshot()


def resumed_run(rank, world_size, corpus, data_dir, run_dir):
    trainer = trainer_for(corpus, data_dir, run_dir, *FSDP4, *SNAPSHOTS)
    resumed_from = trainer.step
    trainer.train()
    losses = {record["step"]: record["loss"] for record in read_metrics(run_dir)} if rank == 0 else None
    return resumed_from, losses


def test_restarted_ranks_resume_from_the_newest_snapshot_every_rank_holds_in_memory(tiny_corpus, tmp_path):
    data = tmp_path / "data"
    straight = run_ranks(resumed_run, 4, tiny_corpus, data, tmp_path / "straight")
    run_ranks(killed_between_snapshots, 4, tiny_corpus, data, tmp_path / "run")
    resumed = run_ranks(resumed_run, 4, tiny_corpus, data, tmp_path / "run")
    assert [step for step, _ in resumed] == [2] * 4  # step 4 is held by ranks 0-2 only
    reference = straight[0][1]
    assert resumed[0][1] == {step: reference[step] for step in range(3, STEPS + 1)}  # bit for bit
    assert not (tmp_path / "run" / "checkpoints" / "step-00000002").exists()  # nothing was read or written


HSDP = ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.pp=1"]


def on_node(base, rank, numbering):
    """Put this rank's staging (its snapshot buffers) on its node: `numbering[rank]` names the node."""
    os.environ["MEGASCALE_STAGING_DIR"] = str(base / numbering[rank])


def snapshots_then_killed(rank, world_size, corpus, data_dir, run_dir, base):
    on_node(base, rank, ["node-0", "node-0", "node-1", "node-1"])
    trainer = trainer_for(corpus, data_dir, run_dir, *HSDP, *SNAPSHOTS)
    while trainer.step < 4:
        trainer.train_step()
        trainer.step += 1
        if trainer.step % 2 == 0:
            trainer.snapshot()


def renumbered_restart(rank, world_size, corpus, data_dir, run_dir, base):
    """node-0 is gone; node-1 now runs ranks 0-1 (it held ranks 2-3: their replicas), node-2 is new."""
    on_node(base, rank, ["node-1", "node-1", "node-2", "node-2"])
    trainer = trainer_for(corpus, data_dir, run_dir, *HSDP, *SNAPSHOTS)
    left = sorted(path.name.split("-")[1] for path in (base / "node-1" / "snapshots").glob("*.bin"))
    resumed_from = trainer.step
    trainer.train()
    losses = {record["step"]: record["loss"] for record in read_metrics(run_dir)} if rank == 0 else None
    return resumed_from, losses, left


def straight_hsdp(rank, world_size, corpus, data_dir, run_dir, base):
    on_node(base, rank, ["a", "a", "b", "b"])
    trainer_for(corpus, data_dir, run_dir, *HSDP, *SNAPSHOTS).train()
    return {record["step"]: record["loss"] for record in read_metrics(run_dir)} if rank == 0 else None


def test_a_replaced_node_restores_from_the_replicas_memory_and_the_survivors_from_their_old_buffers(
    tiny_corpus, tmp_path
):
    """dp_replicate=2 x dp_shard=2, a replica on each of two nodes. node-0 is lost with its memory; the
    survivor node-1 is numbered ranks 0-1 now and a new node-2 ranks 2-3. Ranks 0-1 restore from the
    buffers ranks 2-3 left on node-1 (their replicas: the same shards); ranks 2-3 hold nothing and receive
    the state from ranks 0-1. The run resumes at step 4 from memory and trains the straight run's losses;
    the old ranks' buffers on node-1 are gone once read."""
    data, base = tmp_path / "data", tmp_path / "shm"
    straight = run_ranks(straight_hsdp, 4, tiny_corpus, data, tmp_path / "straight", base)
    run_ranks(snapshots_then_killed, 4, tiny_corpus, data, tmp_path / "run", base)
    shutil.rmtree(base / "node-0")
    resumed = run_ranks(renumbered_restart, 4, tiny_corpus, data, tmp_path / "run", base)
    assert [step for step, _, _ in resumed] == [4] * 4
    reference = straight[0]
    assert resumed[0][1] == {step: reference[step] for step in range(5, STEPS + 1)}  # bit for bit
    assert resumed[0][2] == ["00000", "00000", "00001", "00001"]  # ranks 2-3's buffers removed
    assert not (tmp_path / "run" / "checkpoints" / "step-00000004").exists()
