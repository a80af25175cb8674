"""Goodput: the effective training time ratio (ETTR) of a run, from its own records, and its chart.

ETTR is the share of wall-clock time spent on steps that count (MegaScale §6, ByteRobust): the time a job
loses to a fault is its detection, its recovery, and the steps trained again after it, and none of that
is on the final loss curve. Here a step counts when its record is the last one of its number in
metrics.jsonl (a restart logs the steps it redoes again), and the time spent on it is the time since the
previous step's record when both come from the same attempt (the `start` events divide the records),
else its own `step_time_s`: so a step's share of logging, snapshots and waiting for data counts, and the
start-up before an attempt's first step does not.
"""

from __future__ import annotations

import bisect
import html
import json
from pathlib import Path
from typing import Any

from megascale.observe.metrics import read_metrics

Records = list[dict[str, Any]]
MAX_POINTS = 3000  # a long run's chart keeps a few thousand points


def final_curve(records: Records) -> dict[int, dict[str, Any]]:
    """The record each step ends with: the last of its number (a redone step's second record)."""
    return {record["step"]: record for record in records if "loss" in record}


def productive_seconds(records: Records, events: Records) -> float:
    """Seconds spent on the steps of the final curve (see the module's docstring)."""
    starts = sorted(event["time"] for event in events if event["event"] == "start")
    curve = final_curve(records)

    def attempt_of(time: float) -> int:
        return bisect.bisect_right(starts, time)

    seconds = 0.0
    for step, record in curve.items():
        before = curve.get(step - 1)
        if before is not None and attempt_of(before["time"]) == attempt_of(record["time"]):
            seconds += record["time"] - before["time"]
        else:
            seconds += record.get("step_time_s", 0.0)
    return seconds


def ettr(records: Records, events: Records, began: float, ended: float) -> dict[str, float]:
    """{'ettr', 'productive_s', 'wall_s'} of a run that began and ended at these times (unix seconds)."""
    productive, wall = productive_seconds(records, events), ended - began
    return {"ettr": productive / wall if wall > 0 else 0.0, "productive_s": productive, "wall_s": wall}


def progress_chart(
    records: Records, faults: list[dict[str, Any]], began: float, width: int = 1280, height: int = 260
) -> str:
    """An SVG of the step every logged record reached against the seconds since `began`, one vertical mark
    per fault (`{'time', 'fault'}`): a flat stretch or a drop after a mark is what that fault cost."""
    logged = [(record["time"] - began, record["step"]) for record in records if "loss" in record]
    every = max(1, len(logged) // MAX_POINTS)
    # Every `every`-th point, and each one where the step went back (a restart redoing steps).
    points = [
        point
        for i, point in enumerate(logged)
        if i % every == 0 or i == len(logged) - 1 or (i and point[1] < logged[i - 1][1])
    ]
    if not points:
        return "<p>no step logged</p>"
    left, right, top, bottom = 60, 12, 24, 30
    x_max = max(max(x for x, _ in points), *(fault["time"] - began for fault in faults), 1.0)
    y_max = max(max(y for _, y in points), 1)

    def px(x: float) -> float:
        return left + x / x_max * (width - left - right)

    def py(y: float) -> float:
        return top + (1 - y / y_max) * (height - top - bottom)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" role="img" '
        'font-family="sans-serif" font-size="11">',
        '<text x="4" y="13">step reached, by seconds since the launch; a red mark per fault</text>',
        f'<path d="M{left} {top}V{height - bottom}H{width - right}" stroke="#888" fill="none"/>',
        f'<text x="{left - 6}" y="{top + 4}" text-anchor="end">{y_max}</text>',
        f'<text x="{left - 6}" y="{height - bottom}" text-anchor="end">0</text>',
        f'<text x="{width - right}" y="{height - 8}" text-anchor="end">{x_max:.0f} s</text>',
    ]
    for fault in faults:
        x, name = px(fault["time"] - began), html.escape(fault["fault"])
        parts.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{height - bottom}" stroke="#d62728" '
            f'stroke-dasharray="3 2"><title>{name} at {fault["time"] - began:.0f} s</title></line>'
            f'<text transform="translate({x + 3:.1f} {top + 4}) rotate(90)" font-size="9" '
            f'fill="#d62728">{name}</text>'
        )
    step_path = "".join(f"{'L' if i else 'M'}{px(x):.1f} {py(y):.1f}" for i, (x, y) in enumerate(points))
    parts.append(f'<path d="{step_path}" fill="none" stroke="#1f77b4" stroke-width="1.4"/>')
    return "".join(parts) + "</svg>"


def goodput_section(run_dir: Path) -> dict[str, tuple[str, str]]:
    """The run report's chart of a soak, where `megascale rehearse --soak` left soak.json in its job's run
    directory: {anchor: (title, svg)}, empty otherwise."""
    if not (run_dir / "soak.json").is_file():
        return {}
    soak = json.loads((run_dir / "soak.json").read_text())
    chart = progress_chart(read_metrics(run_dir), soak["faults"], soak["began"])
    return {"chart-goodput": (f"Goodput under {len(soak['faults'])} faults: ETTR {soak['ettr']:.1%}", chart)}
