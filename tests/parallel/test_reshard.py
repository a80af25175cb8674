"""A checkpoint saved by one layout resumes under others: dp2 x tp2 after step 5, then tp2 x pp2 and one
process each continue to step 10, with the losses of a run that was never interrupted."""

import shutil

from megascale.config import load_config
from megascale.observe.metrics import read_metrics
from megascale.trainer import Trainer
from tests.conftest import TINY
from tests.parallel.multiprocess import run_ranks

STEPS, SAVE_AT = 10, 5
JOB = [
    "--model.n_layers=4",
    "--training.global_batch_size=4",
    "--training.micro_batch_size=1",
    f"--training.steps={STEPS}",
    f"--training.val_every={STEPS}",
    "--optim.grad_clip=0.5",
]


def train(rank, world_size, corpus, data_dir, run_dir, layout, stop_at=None):
    """Train under `layout` from the newest checkpoint in run_dir (or from scratch); with `stop_at`, stop
    there and save a checkpoint. Returns the logged loss of each step this run took."""
    args = [
        *TINY,
        *JOB,
        f"--data.source={corpus}",
        f"--data.cache_dir={data_dir}",
        f"--training.run_dir={run_dir}",
        *layout,
    ]
    trainer = Trainer(load_config(None, args))
    if stop_at is None:
        trainer.train()
    else:
        while trainer.step < stop_at:
            trainer.train_step()
            trainer.step += 1
        trainer.save_checkpoint(blocking=True)
    return {record["step"]: record["loss"] for record in read_metrics(run_dir)} if rank == 0 else None


def test_dp2xtp2_checkpoint_resumes_as_tp2xpp2_and_as_one_process(tiny_corpus, tmp_path):
    data = tmp_path / "data"
    reference = run_ranks(train, 1, tiny_corpus, data, tmp_path / "straight", [])[0]

    saved = tmp_path / "saved"
    run_ranks(train, 4, tiny_corpus, data, saved, ["--parallel.dp_shard=2", "--parallel.tp=2"], SAVE_AT)
    for name in ("tp2xpp2", "one"):
        shutil.copytree(saved, tmp_path / name)
    resumed = {
        "tp2 x pp2": run_ranks(
            train, 4, tiny_corpus, data, tmp_path / "tp2xpp2", ["--parallel.tp=2", "--parallel.pp=2"]
        )[0],
        "1 process": run_ranks(train, 1, tiny_corpus, data, tmp_path / "one", [])[0],
    }
    for layout, losses in resumed.items():
        assert sorted(losses) == list(range(SAVE_AT + 1, STEPS + 1))
        delta = max(abs(losses[step] - reference[step]) for step in losses)
        print(
            f"saved at dp2 x tp2 step {SAVE_AT}, resumed as {layout}: max |delta loss| steps "
            f"{SAVE_AT + 1}-{STEPS} = {delta:.2e}"
        )
        assert delta <= 1e-4
