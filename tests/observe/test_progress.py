"""The console's progress bar (observe/progress.py): its ETA counts to the step the run will stop at."""

from megascale.observe import progress as progress_module
from megascale.trainer import Trainer


def test_the_bar_and_its_eta_end_at_stop_at_step(tiny_config, monkeypatch):
    bars = []

    class Recorded(progress_module.TrainingProgress):
        def __exit__(self, *exc: object) -> None:
            task = self._progress.tasks[0]
            bars.append((task.total, task.completed))
            super().__exit__(*exc)

    monkeypatch.setattr("megascale.trainer.TrainingProgress", Recorded)
    Trainer(tiny_config("--training.steps=6", "--training.stop_at_step=2")).train()
    assert bars == [(2, 2)]  # done at the end: no ETA left, where a bar of 6 steps would show 4 to go
