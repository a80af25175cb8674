"""When the job hangs: every rank writes down where it stands, and `megascale trace hang` names the culprit.

A hang names no one by itself: every healthy rank sits in a collective waiting for the one that never
comes (paper §5.2). Each rank keeps, per process group, how many operations it has started and how many
it knows finished (observe/collectives.py). A watch thread in every rank notices when its rank has made no
step for `metrics.hang_dump_s` and writes that state, with the operation the training thread is blocked
in and the phase it is in, to `<trace session>/hang/rank-RRRRR.json`; a rank stuck outside any collective
(in compute, in Python, in a dead peer's place) still writes, since the watch is its own thread.

The analysis lines the ranks up group by group. A rank that started fewer operations on a group than the
group's other members, while not itself blocked in any operation, is what they wait for: the suspect.
A rank that wrote nothing at all is a suspect too (stuck without releasing the interpreter, or dead).
When every rank is blocked in some operation (a mismatch, not a straggler), the ranks furthest behind
are named instead. torch's flight recorder keeps similar records, but on gloo without completions and
behind a private dump call; these are the same few numbers, kept where the analysis needs them.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # a type only: the driver reads dumps with this module and must not import torch for it
    from megascale.observe.timeline import Timeline

HANG = "hang"


class HangWatch(threading.Thread):
    """Writes this rank's state once per stall of `stall_s` seconds without a new step."""

    def __init__(self, timeline: Timeline, directory: Path, stall_s: float, world_size: int):
        super().__init__(name="megascale-hang-watch", daemon=True)
        self.timeline, self.stall_s, self.world_size = timeline, stall_s, world_size
        self.path = directory / HANG / f"rank-{timeline.rank:05d}.json"
        self._stopped = threading.Event()

    def run(self) -> None:
        seen, since, dumped = self.timeline.steps_begun, time.monotonic(), False
        while not self._stopped.wait(min(1.0, self.stall_s / 4)):
            now, steps = time.monotonic(), self.timeline.steps_begun
            if steps != seen:
                seen, since, dumped = steps, now, False
            elif steps > 0 and not dumped and now - since > self.stall_s:
                self.dump(now - since)
                dumped = True

    def dump(self, stalled_s: float) -> None:
        from megascale.observe.collectives import communication_state  # torch's: in a rank, not the driver

        state = {
            "rank": self.timeline.rank,
            "world_size": self.world_size,
            "coords": self.timeline.coords,
            "step": self.timeline.steps_begun,
            "phase": self.timeline.phase,
            "stalled_s": round(stalled_s, 1),
            "time": time.time(),
            **communication_state(self.timeline.thread),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staged = self.path.with_suffix(".tmp")
        staged.write_text(json.dumps(state))
        staged.replace(self.path)

    def stop(self) -> None:
        """End the watch; returns once its thread has (it wakes at once), so none outlives the run."""
        self._stopped.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout=5.0)


def read_dumps(directory: Path) -> dict[int, dict[str, Any]]:
    return {
        int(path.stem.split("-")[1]): json.loads(path.read_text()) for path in directory.glob("rank-*.json")
    }


def analyze(dumps: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """{'suspects': [rank, ...], 'reasons': {rank: why}, 'silent': [...], 'behind': {rank: [group, ...]}}."""
    world = max([dump["world_size"] for dump in dumps.values()] or [0])
    silent = [rank for rank in range(world) if rank not in dumps]
    # A group is its name and members (each pipeline stage has its own data-parallel group of one name).
    issued: dict[tuple[str, tuple[int, ...]], dict[int, int]] = {}
    for rank, dump in dumps.items():
        for group in dump["groups"]:
            issued.setdefault((group["name"], tuple(group["ranks"])), {})[rank] = group["issued"]
    behind: dict[int, list[str]] = {}
    for (name, members), counts in issued.items():
        top = max(counts.values())
        for rank in members:
            if rank in counts and counts[rank] < top:
                behind.setdefault(rank, []).append(f"{name} ({counts[rank]} of {top} operations started)")
    reasons: dict[int, str] = {
        rank: "wrote no state: stuck without a free interpreter, or gone" for rank in silent
    }
    for rank, groups in behind.items():
        if dumps[rank]["waiting"] is None:
            reasons[rank] = (
                f"not in any collective (phase {dumps[rank]['phase'] or 'none'}, step {dumps[rank]['step']}) "
                f"while its peers wait for it on {'; '.join(groups)}"
            )
    if not reasons and behind:  # everyone blocked: name those furthest behind
        for rank, groups in behind.items():
            waiting = dumps[rank]["waiting"]
            reasons[rank] = (
                f"behind on {'; '.join(groups)}, blocked in {waiting['kind']} on {waiting['group']}"
            )
    return {"suspects": sorted(reasons), "reasons": reasons, "silent": silent, "behind": behind}


def describe(dumps: dict[int, dict[str, Any]], result: dict[str, Any]) -> str:
    """The analysis as text: one line per rank, then the suspects."""
    lines = []
    for rank in sorted(dumps):
        dump = dumps[rank]
        coords = ", ".join(f"{key} {value}" for key, value in dump["coords"].items())
        waiting = dump["waiting"]
        where = (
            f"blocked in {waiting['kind']} #{waiting.get('seq', '?')} on {waiting.get('group')}"
            if waiting
            else "in no collective"
        )
        lines.append(f"rank {rank} ({coords}): step {dump['step']}, phase {dump['phase'] or '-'}, {where}")
    for rank in result["silent"]:
        lines.append(f"rank {rank}: no state written")
    if result["suspects"]:
        lines.append("suspects:")
        lines += [f"  rank {rank}: {result['reasons'][rank]}" for rank in result["suspects"]]
    else:
        lines.append("no suspect: every rank is at the same place in every group")
    return "\n".join(lines)
