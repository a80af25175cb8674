"""torchrun as an executor runs it: torch.distributed.run, which on failed workers also leaves the elastic
agent's own account of them (each failed rank's pid and exit status, negative for the signal that ended
it, as the agent read it when it reaped the process) in the attempt's directory.

The executor reads from that record which ranks a signal ended (`signalled_ranks`): the driver's best clue
to which node a fault began on. torchrun prints the same account in its failure summary, but that text is
mixed with the workers' own output and changes with torch's releases; the record is the agent's data.

`python -m megascale.resilience.agent RECORD [torchrun's arguments]` writes the record to RECORD.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

FAILURES = "failures.json"  # in the attempt's directory


def signalled_ranks(record: Path) -> dict[str, str]:
    """{global rank: the name of the signal that ended it} of the failed ranks in the agent's record
    (empty while there is none: no worker failed, or torchrun still runs)."""
    try:
        failures = json.loads(record.read_text())
    except (OSError, ValueError):
        return {}
    signalled = {}
    for rank, failure in failures.items():
        if (code := int(failure["exitcode"])) < 0:
            try:
                signalled[rank] = signal.Signals(-code).name
            except ValueError:
                signalled[rank] = f"signal {-code}"
    return signalled


def run_torchrun(record: Path, arguments: list[str]) -> None:
    """torchrun with `arguments`; when workers fail, their account goes to `record` before torchrun's
    error is raised on (its summary printed, exit status 1, as `python -m torch.distributed.run` does)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(arguments)
    except ChildFailedError as err:
        failures = {
            str(rank): {"pid": failure.pid, "exitcode": failure.exitcode, "local_rank": failure.local_rank}
            for rank, failure in err.failures.items()
        }
        staged = record.with_name(f".{record.name}.tmp")
        staged.write_text(json.dumps(failures))
        os.replace(staged, record)
        raise


if __name__ == "__main__":
    run_torchrun(Path(sys.argv[1]), sys.argv[2:])
