"""Context parallelism's activation memory: what one rank keeps for the backward at cp 1, 2 and 4, the
same model on the same sequence length, side by side in one run.

Counts the bytes of every tensor the forward of one micro-batch saves for its backward (autograd's
saved-tensor hooks, each storage once; parameters left out, FSDP's gathered ones included, as they are
not activations): the activation memory the backward needs, free of the allocator's and the machine's
noise. cp 1 is one process (PyTorch's fused attention); cp 2 and 4 are that many ranks forked from this
process, each holding 2 chunks of every sequence (`parallel/context.py`). Ideally a rank keeps 1/cp of
cp 1's. Prints one `name value` line per figure and writes them as JSON.

    python bench/context.py --out bench/results/context.json   # under a minute on 2 cores
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.*, run as a script

from bench.record import save_record  # noqa: E402
from megascale.config import load_config  # noqa: E402
from megascale.models.llama import Transformer  # noqa: E402
from megascale.parallel.context import shard_sequence  # noqa: E402
from megascale.parallel.dims import ParallelDims  # noqa: E402
from megascale.parallel.parallelize import parallelize  # noqa: E402
from megascale.trainer import next_token_loss  # noqa: E402
from tests.parallel.multiprocess import run_ranks  # noqa: E402

MODEL = [
    "--model.dim=256",
    "--model.n_layers=4",
    "--model.attention.n_heads=8",
    "--model.attention.n_kv_heads=4",
    "--training.global_batch_size=4",
    "--training.micro_batch_size=1",
]
DEGREES = (1, 2, 4)


def saved_bytes(forward: Any) -> int:
    """Bytes of the activations `forward()` saves for its backward, each storage counted once."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if not (tensor.is_leaf and tensor.requires_grad):  # a parameter is not an activation
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(storages.values())


def rank_memory(rank: int, world: int, seq_len: int) -> int:
    """This rank's activation bytes for one micro-batch of `seq_len` tokens, its sequence over `world`."""
    cfg = load_config(
        None,
        [*MODEL, f"--model.max_seq_len={seq_len}", f"--data.seq_len={seq_len}", f"--parallel.cp={world}"],
    )
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    if world > 1:
        dims = ParallelDims.from_config(cfg, world)
        dims.build_mesh("cpu")
        parallelize(model, dims, cfg.parallel, device=torch.device("cpu"), microbatches=1)
    tokens = torch.randint(cfg.model.vocab_size, (1, seq_len + 1), generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    if world > 1:
        inputs, labels = shard_sequence(inputs, world, rank), shard_sequence(labels, world, rank)
    return saved_bytes(lambda: next_token_loss(model(inputs), labels))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "context.json")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (divisible by 8)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    figures: dict[str, float] = {}
    for cp in DEGREES:
        per_rank = [rank_memory(0, 1, args.seq_len)] if cp == 1 else run_ranks(rank_memory, cp, args.seq_len)
        figures[f"cp{cp}_activation_mib_per_rank"] = max(per_rank) / 2**20
    for cp in DEGREES[1:]:
        figures[f"cp{cp}_over_cp1"] = (
            figures[f"cp{cp}_activation_mib_per_rank"] / figures["cp1_activation_mib_per_rank"]
        )
    for name, value in figures.items():
        print(f"{name} {value:.4g}")
    setup = {"model": MODEL, "seq_len": args.seq_len, "degrees": DEGREES}
    save_record(args.out, figures, setup)


if __name__ == "__main__":
    main()
