"""`megascale rehearse`: a fault done from outside to a real launched job, read back into the table."""

import json
import subprocess
import sys

import pytest

from megascale.resilience.rehearsal import cause, table


@pytest.mark.slow
def test_the_rehearsal_does_a_fault_from_outside_and_tables_what_happened(tiny_corpus, tmp_path):
    """The reference and the rank-SIGKILL row: the row is detected, recovered by itself, trained to the
    reference's losses bit for bit, and leaves no process and no byte of staging; exit 0."""
    work = tmp_path / "rehearsal"
    result = subprocess.run(
        [
            sys.executable, "-m", "megascale.cli", "rehearse", "--work", str(work),
            "--faults", "rank SIGKILL", f"--data.source={tiny_corpus}",
        ],
        capture_output=True, text=True, timeout=500,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (row,) = json.loads((work / "rehearsal.json").read_text())
    assert row["fault"] == "rank SIGKILL" and row["detected_as"] in ("rank_exit", "process_exit")
    assert 0 < row["detected_after_s"] < 10 and row["recovered"] and row["losses_equal"]
    assert row["processes_left"] == 0 and row["shm_bytes_left"] == 0
    assert row["fault_to_next_step_s"] > row["detected_after_s"]
    assert "| rank SIGKILL | SIGKILL rank 1 at step 3 |" in (work / "rehearsal.md").read_text()


def test_a_row_that_ended_says_its_cause_and_the_operators_command():
    row = {
        "fault": "deleted checkpoints", "how": "delete them", "detected_after_s": 2.2,
        "detected_as": "process_exit", "diagnosis": "2 node(s) passed", "recovered": False, "done": True,
        "exit_codes": [2, 0], "operator": "`megascale launch --checkpoint.resume=false`",
        "cause": cause(
            "an error in the job's input: rank 0: checkpoint: every checkpoint of this run is gone: step 8 "
            "was committed to /x/step-00000008 (/r/checkpoints.jsonl), and none is under /x now; restore"
        ),
        "steps_redone": 9, "losses_equal": True, "processes_left": 0, "shm_bytes_left": 0,
        "fault_to_next_step_s": 26.0,
    }  # fmt: skip
    assert (
        "| ended (exit 2: checkpoint: every checkpoint of this run is gone), then "
        "`megascale launch --checkpoint.resume=false`: done | 9 | yes | 0 | 0 | 26.0 s |"
    ) in table([row])
