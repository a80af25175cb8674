"""Node-shared loading on real processes: under tp2 both ranks train on identical batches while only the
reader touches the shards; the taker follows the reader across a checkpoint load; a dead or silent reader
fails the taker with an error naming it."""

from __future__ import annotations

import dataclasses
import hashlib
import time

import pytest
import torch
import torch.distributed as dist

from megascale.config import DataConfig, load_config
from megascale.data import build_dataloaders, prepare_dataset
from megascale.data.loader import TrainLoader
from megascale.data.shards import TokenShards
from megascale.errors import DataError
from megascale.trainer import Trainer
from tests.conftest import tiny_args
from tests.parallel.multiprocess import run_ranks

STEPS = 4


def count_calls(cls, name: str) -> list:
    """Patch cls.name (in this process only) to note each call; returns the list it appends to."""
    calls: list = []
    original = getattr(cls, name)

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    setattr(cls, name, counted)
    return calls


def record_batches(digests: list) -> None:
    """Patch TrainLoader.__next__ (in this process only) to note a digest of every batch taken."""
    original = TrainLoader.__next__

    def recorded(self):
        inputs, labels = original(self)
        digests.append(hashlib.sha256(inputs.numpy().tobytes() + labels.numpy().tobytes()).hexdigest())
        return inputs, labels

    TrainLoader.__next__ = recorded


def train_tp2(rank, world_size, corpus, root, share):
    """A tp2 Trainer run; this rank's shard reads (token range reads) and the digests of its batches."""
    shard_reads = count_calls(TokenShards, "tokens")
    digests: list = []
    record_batches(digests)
    args = tiny_args(
        corpus,
        root / f"run-{share}",
        root / "data",
        "--parallel.tp=2",
        f"--data.share_per_node={share}",
        "--data.val_fraction=0",  # no validation: every shard read is a training batch
        f"--training.steps={STEPS}",
        "--checkpoint.enabled=false",
        "--metrics.timeline=false",
    )
    trainer = Trainer(load_config(None, args))
    summary = trainer.train()
    return len(shard_reads), digests, summary["loss"], trainer.grad_accum_steps


@pytest.mark.parametrize("share", [True, False])
def test_tp2_ranks_get_identical_batches_read_once_per_node(tiny_corpus, tmp_path, share):
    (reads0, digests0, loss0, accum), (reads1, digests1, loss1, _) = run_ranks(
        train_tp2, 2, tiny_corpus, tmp_path, share, timeout_s=120
    )
    taken = STEPS * accum
    print(f"share_per_node={share}: shard reads per rank {reads0}, {reads1} for {taken} micro-batches of 2")
    assert len(digests0) == len(digests1) == taken
    assert digests0 == digests1 and loss0 == loss1
    # A reader reads its batches and those its thread prepared ahead (a step's, and one waiting to be
    # queued), 2 sequences each.
    assert 2 * taken <= reads0 <= 2 * (taken + accum + 1)
    if share:
        assert reads1 == 0
    else:
        assert 2 * taken <= reads1 <= 2 * (taken + accum + 1)


def train_loader_for(cfg: DataConfig, timeout_s: float = 60.0) -> TrainLoader:
    train, _ = build_dataloaders(
        cfg, model_vocab_size=264, micro_batch_size=2, seed=1, micro_batches_per_step=2, timeout_s=timeout_s
    )
    return train


def follow_across_load(rank, world_size, cfg):
    """Both ranks take 6 batches, rewind to batch 2 (the reader's thread had published ahead), take 6."""
    train = train_loader_for(cfg)
    taken = [next(train)[0] for _ in range(6)]
    train.load_state_dict({"consumed_sequences": 4})
    taken += [next(train)[0] for _ in range(6)]
    # The taker may take batches the reader published before the load (the same ones) and be done while
    # the reader still publishes them again for itself: a taker that has left fails that publish. In
    # training each step's collectives keep the ranks together; here the barrier does.
    dist.barrier()
    train.close()
    alone = train_loader_for(dataclasses.replace(cfg, share_per_node=False, prefetch=0))
    reference = [next(alone)[0] for _ in range(8)]
    assert all(torch.equal(a, b) for a, b in zip(taken, reference[:6] + reference[2:8], strict=True))
    return train.ring.group.is_reader


def test_taker_follows_the_reader_across_a_checkpoint_load(tiny_corpus, tmp_path):
    cfg = DataConfig(source=str(tiny_corpus), cache_dir=str(tmp_path / "data"), seq_len=32, prefetch=2)
    prepare_dataset(cfg, progress=False)
    assert run_ranks(follow_across_load, 2, cfg, timeout_s=60) == [True, False]  # rank 0 reads


def lose_the_reader(rank, world_size, cfg):
    """Rank 0 (the reader) publishes one batch then stays silent, later exits; rank 1 reports both."""
    train = train_loader_for(cfg, timeout_s=1.0)
    errors = []
    if rank == 0:
        next(train)
        dist.barrier()  # rank 1 took batch 0 and waited out its timeout for batch 1
        train.close()
        dist.barrier()
        return errors
    next(train)
    started = time.monotonic()
    with pytest.raises(DataError) as silent:
        next(train)
    errors.append((str(silent.value), time.monotonic() - started))
    dist.barrier()
    dist.barrier()  # the reader has closed its end now
    with pytest.raises(DataError) as gone:
        next(train)
    errors.append((str(gone.value), 0.0))
    train.close()
    return errors


def test_silent_or_dead_reader_fails_the_taker_naming_it(tiny_corpus, tmp_path):
    cfg = DataConfig(source=str(tiny_corpus), cache_dir=str(tmp_path / "data"), seq_len=32, prefetch=0)
    prepare_dataset(cfg, progress=False)
    _, errors = run_ranks(lose_the_reader, 2, cfg, timeout_s=60)
    (silent, waited_s), (gone, _) = errors
    assert silent == (
        "data: rank 1 waited 1 s for the batch at stream position 2 from its node's reader, rank 0; that "
        "rank is hung or far behind (see its log)"
    )
    assert 0.9 < waited_s < 5
    assert gone == "data: rank 1 lost its node's batch reader, rank 0 (it exited or failed; see its log)"


def test_ranks_in_another_network_namespace_are_another_node(two_hosts):
    """Network namespaces of one machine share its host name but not their sockets: the batch reader of
    one cannot be reached from the other, so sharing must count them as two nodes (before this was fixed,
    the node was the host name, and a tp2 x pp2 job over two such hosts waited for its reader until the
    timeout)."""
    import subprocess
    import sys

    from megascale.data.node_share import node_name

    probe = [sys.executable, "-c", "from megascale.data.node_share import node_name; print(node_name())"]
    names = []
    for host in (0, 1):
        proc = two_hosts.start(host, probe, stdout=subprocess.PIPE, text=True)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        names.append(out.strip())
    assert names[0] != names[1]
    assert node_name() not in names  # this process is in neither namespace
    same = subprocess.run(probe, capture_output=True, text=True, timeout=60).stdout.strip()
    assert same == node_name()  # and two processes of one namespace are one node
