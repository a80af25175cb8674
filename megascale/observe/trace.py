"""`megascale trace merge`: every rank's timeline in one Chrome trace, and a check of the format.

Each rank's file already counts time from the barrier all ranks left together (timeline.py), so merging
is concatenation plus naming: each rank becomes a process named by its place in the layout and sorted by
pipeline stage, then data-parallel rank, then tensor-parallel rank, so that Perfetto shows the stages as
groups of rows. `check_trace` holds a trace to the trace-event format's rules for the events we write,
and to ours: on every track, spans in order and never overlapping.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megascale.errors import MegascaleError

MERGED = "merged.json"
METADATA = {
    "process_name",
    "process_sort_index",
    "process_labels",
    "thread_name",
    "thread_sort_index",
    "trace_end",
}


TRACES = "traces"  # under the run directory: a session's directory per start or resume, a file per rank


def read_trace(path: Path) -> list[dict[str, Any]]:
    """A per-rank trace file's events, whether it was closed or cut short by a crash."""
    text = path.read_text().rstrip()
    if not text.endswith("]"):
        text = text.rstrip(",") + "\n]"
    return json.loads(text)


def sessions(run_dir: Path) -> list[Path]:
    """The run's trace sessions (one per start or resume), oldest first."""
    root = Path(run_dir) / TRACES
    return sorted(path for path in root.glob("from-step-*") if path.is_dir()) if root.is_dir() else []


def merge_traces(run_dir: Path, session: Path | None = None, out: Path | None = None) -> Path:
    """Merge the newest session's (or `session`'s) rank files into one trace; returns its path."""
    if session is None:
        found = sessions(run_dir)
        if not found:
            raise MegascaleError(
                f"trace: no traces under {Path(run_dir) / TRACES} (is it a run directory? "
                "was metrics.timeline off?)"
            )
        session = found[-1]
    files = sorted(session.glob("rank-*.json"))
    if not files:
        raise MegascaleError(f"trace: {session} holds no rank-*.json files")
    events: list[dict[str, Any]] = []
    ranks = []
    for path in files:
        rank_events = read_trace(path)
        labels: dict[str, Any] = next(
            (e["args"] for e in rank_events if e.get("name") == "process_labels"), {}
        )
        coords = labels.get("coords", {})
        rank = int(path.stem.split("-")[1])
        ranks.append(rank)
        pp, dp, tp = (coords.get(key, 0) for key in ("pp", "dp", "tp"))
        experts = f" · ep {coords['ep']}" if "ep" in coords else ""  # the expert-parallel rank, with ep
        for event in rank_events:
            if event.get("name") in ("process_name", "process_sort_index", "trace_end"):
                continue
            events.append(event)
        events.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": rank,
                "args": {"name": f"pp {pp} · dp {dp}{experts} · tp {tp} · rank {rank}"},
            }
        )
        events.append(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": rank,
                "args": {"sort_index": (pp * 1000 + dp) * 1000 + tp},
            }
        )
    out = out or session / MERGED
    trace = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"run_dir": str(run_dir), "session": session.name, "ranks": ranks},
    }
    staged = out.with_suffix(".tmp")
    staged.write_text(json.dumps(trace))
    staged.replace(out)
    return out


def check_trace(trace: dict[str, Any] | list[dict[str, Any]]) -> list[str]:
    """What is wrong with a trace (empty when nothing is): the format's required fields and types for
    complete (X) and metadata (M) events, and spans ordered and not overlapping on each track."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    problems = []
    tracks: dict[tuple[Any, Any], list[tuple[float, float, str]]] = {}
    for index, event in enumerate(events):
        phase = event.get("ph")
        where = f"event {index} ({event.get('name')!r})"
        if phase == "X":
            missing = [key for key in ("name", "ts", "dur", "pid", "tid") if key not in event]
            if missing:
                problems.append(f"{where}: missing {', '.join(missing)}")
                continue
            if not isinstance(event["ts"], (int, float)) or not isinstance(event["dur"], (int, float)):
                problems.append(f"{where}: ts and dur must be numbers")
            elif event["dur"] < 0:
                problems.append(f"{where}: negative duration {event['dur']}")
            if "args" in event and not isinstance(event["args"], dict):
                problems.append(f"{where}: args must be an object")
            tracks.setdefault((event["pid"], event["tid"]), []).append(
                (event["ts"], event["ts"] + event["dur"], event["name"])
            )
        elif phase == "M":
            if (
                event.get("name") not in METADATA
                or "pid" not in event
                or not isinstance(event.get("args"), dict)
            ):
                problems.append(f"{where}: not a metadata event of the format")
        else:
            problems.append(f"{where}: unexpected phase {phase!r}")
    for (pid, tid), spans in tracks.items():
        spans.sort()
        for (start, end, name), (next_start, _, next_name) in zip(spans, spans[1:]):
            if next_start < end - 1e-3:  # microseconds; allow rounding
                problems.append(
                    f"rank {pid} track {tid}: {next_name!r} at {next_start} overlaps {name!r} ({start}-{end})"
                )
                break
    return problems
