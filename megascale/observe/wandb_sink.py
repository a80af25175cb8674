"""Weights & Biases as a metrics sink beside metrics.jsonl and TensorBoard (`metrics.wandb`).

W&B is an optional dependency, imported only when a run asks for it. One W&B run per megascale run
directory: its id is derived from the directory's path, so a resumed run continues the same W&B run
(`resume="allow"`; offline, in another offline directory of the same id, which `wandb sync` merges). W&B
keeps each run's steps increasing, so the steps a resume repeats after its checkpoint keep their first
values there (metrics.jsonl holds the repeated ones). The run gets the job's config, every logged scalar at
its step, and at the end the run report (report.html, `megascale report`). Console capture and system
statistics are off: the trainer's log and timeline already hold them. When the run ends, the log says once
where it went: the offline run's directory and the `wandb sync` command that uploads it, or the online
run's page.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from megascale.errors import ConfigError, MegascaleError

log = logging.getLogger(__name__)


def wandb_run_id(run_dir: Path) -> str:
    """The W&B run id of a run directory: the same for every resume of it."""
    return hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]


class WandbSink:
    """A W&B run fed the scalars MetricsWriter writes; `close` attaches the report and finishes it."""

    def __init__(self, run_dir: Path, mode: str, project: str, entity: str | None, config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                f"metrics.wandb = {mode!r} needs the wandb package: pip install 'megascale[wandb]', or set "
                "--metrics.wandb=off"
            ) from None
        os.environ.setdefault("WANDB_SILENT", "true")
        self._wandb, self.run_dir, self.offline = wandb, run_dir, mode == "offline"
        self.run = wandb.init(
            mode="offline" if mode == "offline" else "online",
            dir=str(run_dir),
            project=project,
            entity=entity,
            id=wandb_run_id(run_dir),
            name=run_dir.resolve().name,
            config=config,
            resume="allow",
            settings=wandb.Settings(console="off", x_disable_stats=True, save_code=False),
        )

    def write(self, step: int, numbers: dict[str, int | float]) -> None:
        self.run.log(numbers, step=step)

    def close(self) -> None:
        from megascale.observe.report import write_report

        try:
            report = write_report(self.run_dir)
        except MegascaleError as err:  # no step was logged
            log.warning("wandb: no run report attached: %s", err)
        else:
            self.run.save(str(report), base_path=str(self.run_dir), policy="now")
        where = self.run.settings.sync_dir if self.offline else self.run.url
        self.run.finish()
        self._wandb.teardown()  # ends W&B's service process: nothing left behind
        if self.offline:
            log.info("wandb: offline run in %s; upload it with `wandb sync %s`", where, where)
        elif where:
            log.info("wandb: run at %s", where)
