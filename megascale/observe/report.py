"""`megascale report`: one static HTML page per run, from what the run directory already holds.

A run's record is spread over metrics.jsonl, events.jsonl, train.log and the traces; the page puts the
curves, the step-time breakdown, the per-rank heat map of paper §5.1 (with expert parallelism, the expert
load of each ep rank beside it), the stragglers and the driver's faults and restarts side by side, so that
one look says how the run went and where its time went. The charts are SVG drawn here rather than by a
charting library: the page must be one file that opens offline from file:// (no CDN, no script, no font
to fetch) and can be attached to a ticket; hovering a bar, a heat-map cell or a validation point shows its
numbers through SVG <title>s. Long runs are averaged into at most MAX_COLUMNS columns, so the page stays
small.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megascale.errors import MegascaleError
from megascale.observe.events import read_events
from megascale.observe.goodput import goodput_section
from megascale.observe.hang import HANG
from megascale.observe.metrics import read_metrics
from megascale.observe.trace import MERGED, sessions

Records = list[dict[str, Any]]
Series = tuple[str, str, list[tuple[float, float]]]  # label, colour, (step, value) points

MAX_COLUMNS = 300
WIDE_SECTIONS = {"chart-breakdown", "heatmap-ranks", "heatmap-ep", "table-events", "chart-goodput"}
WIDE, NARROW = 1280, 640  # SVG user units; the page scales them to the column's width
KINDS = [  # the step's time by kind (timeline.py), bottom to top of the stacked bars
    ("compute_s", "compute", "#4878b8"),
    ("comm_exposed_s", "exposed communication", "#e8903a"),
    ("bubble_s", "pipeline bubble", "#9b72c0"),
    ("data_wait_s", "data wait", "#5fa55a"),
    ("other_s", "other", "#b0b0b0"),
]
PEAK_LABELS = {"measured": "measured peak", "table": "table peak", "config": "configured peak"}
EVENT_CLASSES = {"fault": "bad", "give_up": "bad", "evict": "bad", "nonfinite": "bad", "bad_link": "bad"}
EVENT_CLASSES |= {"restart": "good", "recovered": "good", "done": "good"}
EVENT_CLASSES |= {"straggler": "warn", "slow_steps": "warn", "loss_spike": "warn", "abandoned": "warn"}
STRAGGLER_LINE = re.compile(r"straggler: rank (\d+) computes ([\d.]+)x")  # the trainer's warning
ROUTING_LINE = re.compile(r"routing imbalance: rank (\d+) computes ([\d.]+)x")  # excess its experts explain
CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0 auto;max-width:1340px;padding:12px 24px;color:#222}
h1{font-size:20px;margin:4px 0}h2{font-size:15px;margin:0 0 6px}header p{margin:2px 0;color:#444}
main{display:grid;grid-template-columns:repeat(auto-fit,minmax(600px,1fr));gap:14px;margin-top:10px}
section{border:1px solid #ddd;border-radius:6px;padding:10px 12px;min-width:0}.wide{grid-column:1/-1}
svg{width:100%;height:auto;display:block}svg text{font-size:11px;fill:#444}
.missing{color:#777;font-style:italic}td,th{white-space:nowrap}td:last-child{white-space:normal}
table{border-collapse:collapse;width:100%}td,th{text-align:left;padding:3px 8px;border-bottom:1px solid #eee}
th{color:#555}tr.bad td{background:#fdecea}tr.good td{background:#eaf6ea}tr.warn td{background:#fff6e0}
code{background:#f3f3f3;padding:1px 4px;border-radius:3px}
"""


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    """Write the run's report (default `<run_dir>/report.html`); returns its path."""
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise MegascaleError(
            f"report: {run_dir / 'metrics.jsonl'} does not exist; is {run_dir} a run directory "
            "(training.run_dir) with at least one logged step?"
        )
    out = Path(out) if out is not None else run_dir / "report.html"
    records, events = _records(run_dir), read_events(run_dir)
    stragglers = _stragglers(run_dir, records, events)
    loss, val_loss = _points(records, "loss"), _points(records, "val_loss")
    sections = {
        "chart-loss": (
            "Loss",
            _lines([("train loss", "#1f77b4", loss)], dots=[("val loss", "#ff7f0e", val_loss)]),
        ),
        "chart-lr": ("Learning rate", _lines([("lr", "#2ca02c", _points(records, "lr"))], _sci)),
        "chart-grad-norm": (
            "Gradient norm",
            _lines([("grad norm", "#9467bd", _points(records, "grad_norm"))]),
        ),
        "chart-throughput": ("Throughput", _throughput(records)),
        **_routing(records),
        "chart-breakdown": ("Step time by kind (rank 0)", _breakdown(records)),
        "heatmap-ranks": (
            "Compute time per rank, relative to the step's median",
            _heatmap(records, stragglers),
        ),
        **_expert_parallel(records, stragglers, _routing_imbalances(run_dir)),
        "table-stragglers": ("Stragglers", _straggler_table(stragglers)),
        "link-trace": ("Trace", _trace_link(run_dir, out)),
        "table-events": ("Events (resilience driver)", _event_table(events)),
        **goodput_section(run_dir),
    }
    body = "\n".join(_section(anchor, title, content) for anchor, (title, content) in sections.items())
    page = (
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>megascale report: {_esc(run_dir.resolve().name)}</title><style>{CSS}</style></head>\n"
        f"<body>{_header(run_dir, records, events)}\n<main>\n{body}\n</main></body></html>\n"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    return out


def _records(run_dir: Path) -> Records:
    """One record per step (the last written wins: a resumed run logs its recomputed steps again), in step
    order, with the strings metrics.jsonl stores for non-finite floats turned back into floats."""
    by_step = {}
    for record in read_metrics(run_dir):
        by_step[record["step"]] = {
            k: float(v) if v in ("nan", "inf", "-inf") else v for k, v in record.items()
        }
    return [by_step[step] for step in sorted(by_step)]


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _num(value: float) -> str:
    return f"{value / 1e3:,.4g}k" if abs(value) >= 1e4 else f"{value:.4g}"


def _sci(value: float) -> str:
    return f"{value:.1e}" if value else "0"


def _points(records: Records, key: str, scale: float = 1.0) -> list[tuple[float, float]]:
    return [(r["step"], r[key] * scale) for r in records if isinstance(r.get(key), (int, float))]


def _section(anchor: str, title: str, body: str) -> str:
    css = ' class="wide"' if anchor in WIDE_SECTIONS else ""
    return f'<section id="{anchor}"{css}><h2>{_esc(title)}</h2>\n{body}\n</section>'


def _missing(text: str) -> str:
    return f'<p class="missing">{_esc(text)}</p>'


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round numbers from at or below `low` to at or above `high`."""
    if high <= low:
        low, high = low - (abs(low) or 1.0) / 2, high + (abs(high) or 1.0) / 2
    base = 10 ** math.floor(math.log10((high - low) / count))
    step = next(base * m for m in (1, 2, 2.5, 5, 10) if base * m >= (high - low) / count)
    first, last = math.floor(low / step + 1e-9), math.ceil(high / step - 1e-9)
    return [i * step for i in range(first, last + 1)]


def _frame(
    width: int, height: int, x_span: tuple[float, float], y_ticks: list[float], y_fmt: Callable, label: str
):
    """An SVG's opening, y grid and axes; returns (parts, x→px, y→px). The caller labels the steps."""
    left, right, top, bottom = 60, 12, 24, 28
    (x0, x1), (y0, y1) = x_span, (y_ticks[0], y_ticks[-1])
    x1 = x1 if x1 > x0 else x0 + 1

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (width - left - right)

    def py(y: float) -> float:
        return top + (y1 - y) / (y1 - y0) * (height - top - bottom)

    parts = [f'<svg viewBox="0 0 {width} {height}" role="img"><text x="4" y="13">{_esc(label)}</text>']
    for tick in y_ticks:
        y = f"{py(tick):.1f}"
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y}" y2="{y}" stroke="#eee"/>')
        parts.append(
            f'<text x="{left - 6}" y="{float(y) + 4:.1f}" text-anchor="end">{_esc(y_fmt(tick))}</text>'
        )
    parts.append(f'<path d="M{left} {top}V{height - bottom}H{width - right}" stroke="#888" fill="none"/>')
    parts.append(f'<text x="{left - 6}" y="{height - 10}" text-anchor="end">step</text>')
    return parts, px, py


def _legend(parts: list[str], width: int, entries: list[tuple[str, str]]) -> None:
    x: float = width - 12
    for label, colour in reversed(entries):
        x -= 6.5 * len(label) + 30
        parts.append(f'<rect x="{x:.0f}" y="4" width="12" height="10" fill="{colour}"/>')
        parts.append(f'<text x="{x + 16:.0f}" y="13">{_esc(label)}</text>')


def _lines(
    series: list[Series], y_fmt: Callable = _num, dots: Sequence[Series] = (), height: int = 240
) -> str:
    """A line per series; a non-finite value breaks its line and is marked in red on the x axis. `dots`
    are drawn as points (validation loss)."""
    dots = [dot for dot in dots if dot[2]]
    finite = [(x, y) for _, _, points in [*series, *dots] for x, y in points if math.isfinite(y)]
    if not finite:
        return _missing("no data logged")
    xs, ys = [x for x, _ in finite], [y for _, y in finite]
    y_ticks = _ticks(min(ys), max(ys))
    parts, px, py = _frame(NARROW, height, (min(xs), max(xs)), y_ticks, y_fmt, "")
    for tick in _ticks(min(xs), max(xs), 10):
        if min(xs) <= tick <= max(xs) and tick % 1 == 0:
            parts.append(f'<text x="{px(tick):.1f}" y="{height - 10}" text-anchor="middle">{tick:g}</text>')
    for label, colour, points in series:
        path, pen_down = [], False
        for x, y in points[:: max(1, len(points) // 2000)]:
            if math.isfinite(y):
                path.append(f"{'L' if pen_down else 'M'}{px(x):.1f} {py(y):.1f}")
            else:
                parts.append(
                    f'<rect x="{px(x) - 1:.1f}" y="{py(y_ticks[0]) - 8:.1f}" width="3" height="8" '
                    f'fill="#d62728"><title>{_esc(label)} non-finite at step {x}</title></rect>'
                )
            pen_down = math.isfinite(y)
        parts.append(f'<path d="{"".join(path)}" fill="none" stroke="{colour}" stroke-width="1.6"/>')
    for label, colour, points in dots:
        parts += [
            f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="4" fill="{colour}"><title>step {x}: {label} '
            f"{y:.4f}</title></circle>"
            for x, y in points
            if math.isfinite(y)
        ]
    _legend(parts, NARROW, [(label, colour) for label, colour, _ in [*series, *dots]])
    return "".join(parts) + "</svg>"


def _throughput(records: Records) -> str:
    tokens = _lines([("tokens/s", "#1f77b4", _points(records, "tokens_per_s"))], height=165)
    mfu = _points(records, "mfu", 100.0)
    if not mfu:
        return tokens + _missing("no MFU: the device's peak is unknown (set --training.peak_tflops)")
    source = next((r["peak_source"] for r in reversed(records) if "peak_source" in r), "")
    label = f"MFU, % of the {PEAK_LABELS.get(source, f'{source} peak')}"
    return tokens + _lines([(label, "#8c564b", mfu)], y_fmt=lambda v: f"{v:.3g}%", height=165)


# One color per MoE layer in the by-layer chart (the first eight of matplotlib's tab10), repeating.
LAYER_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
LAYER_LOAD_KEY = "moe_layer{}_load_max_over_mean"  # parallel/step.py's per-layer metric
LAYER_LOAD = re.compile(LAYER_LOAD_KEY.format(r"(\d+)") + "$")


def _routing(records: Records) -> dict[str, tuple[str, str]]:
    """A run with MoE layers: each step's worst layer imbalance (busiest expert over the mean), each layer's,
    the share of routed slots capacity dropped and the balancing loss; a dense run has no such section."""
    imbalance = _points(records, "moe_load_max_over_mean")
    if not imbalance:
        return {}
    chart = _lines([("busiest expert / mean load, worst layer", "#d62728", imbalance)], height=165)
    layers = sorted(
        {int(match[1]) for record in records for key in record if (match := LAYER_LOAD.match(key))}
    )
    if layers:
        series = [
            (
                f"layer {layer}",
                LAYER_COLORS[i % len(LAYER_COLORS)],
                _points(records, LAYER_LOAD_KEY.format(layer)),
            )
            for i, layer in enumerate(layers)
        ]
        chart += _lines(series, height=165)
    dropped = _lines(
        [("routed slots dropped, %", "#7f7f7f", _points(records, "moe_dropped_fraction", 100.0))],
        y_fmt=lambda v: f"{v:.3g}%",
        height=165,
    )
    balancing = _points(records, "moe_aux_loss")
    if balancing:
        dropped += _lines([("balancing loss (mean over layers)", "#17becf", balancing)], height=165)
    return {"chart-routing": ("Expert routing (MoE)", chart + dropped)}


def _columns(records: Records) -> list[Records]:
    """Consecutive records in at most MAX_COLUMNS groups, one per drawn column."""
    size = math.ceil(len(records) / MAX_COLUMNS)
    return [records[i : i + size] for i in range(0, len(records), size)]


def _steps(group: Records) -> str:
    return f"step {group[0]['step']}" + (f"-{group[-1]['step']}" if len(group) > 1 else "")


def _column_ticks(groups: list[Records], x_of: Callable[[int], float], y: float) -> list[str]:
    """Step labels under a chart of columns, each under the column holding its step."""
    steps = [group[-1]["step"] for group in groups]
    column = {
        tick: next(i for i, step in enumerate(steps) if step >= tick)
        for tick in _ticks(steps[0], steps[-1], 10)
        if groups[0][0]["step"] <= tick <= steps[-1] and tick % 1 == 0
    }
    return [
        f'<text x="{x_of(i):.1f}" y="{y}" text-anchor="middle">{tick:g}</text>' for tick, i in column.items()
    ]


def _breakdown(records: Records) -> str:
    timed = [r for r in records if "compute_s" in r]
    if not timed:
        return _missing("no timeline data (metrics.timeline was off)")
    groups, height = _columns(timed), 260
    means = [
        {key: statistics.fmean(_finite(r.get(key)) for r in group) for key, _, _ in KINDS} for group in groups
    ]
    y_ticks = _ticks(0, max(sum(mean.values()) for mean in means))
    parts, px, py = _frame(
        WIDE, height, (0, len(groups)), y_ticks, lambda v: f"{v:.3g} s", "seconds per step"
    )
    parts += _column_ticks(groups, lambda i: px(i + 0.5), height - 10)
    for index, (group, mean) in enumerate(zip(groups, means)):
        parts.append(
            f"<g><title>{_steps(group)}: "
            + ", ".join(f"{label} {mean[key]:.4f} s" for key, label, _ in KINDS)
            + "</title>"
        )
        base = 0.0
        for key, _, colour in KINDS:
            if mean[key] > 0:
                y, bottom = py(base + mean[key]), py(base)
                parts.append(
                    f'<rect x="{px(index + 0.075):.1f}" y="{y:.1f}" width="{px(0.85) - px(0):.2f}" '
                    f'height="{bottom - y:.2f}" fill="{colour}"/>'
                )
            base += mean[key]
        parts.append("</g>")
    _legend(parts, WIDE, [(label, colour) for _, label, colour in KINDS])
    return "".join(parts) + "</svg>"


def _finite(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0.0


def _floats(values: list[Any]) -> list[float]:
    return [float(v) for v in values]  # also the "nan"/"inf" strings metrics.jsonl stores


def _relative(seconds: list[float]) -> list[float]:
    """Each rank's compute time over the median of the ranks' (nan where unknown)."""
    median = statistics.median([s for s in seconds if math.isfinite(s)] or [1.0]) or 1.0
    return [s / median for s in seconds]


def _colour(ratio: float) -> str:
    """White at the median, redder when slower (full at 2x), bluer when faster (full at 0.5x)."""
    t = max(-1.0, min(1.0, math.log2(ratio))) if ratio > 0 else -1.0
    target = (215, 48, 39) if t > 0 else (33, 102, 172)
    return "#" + "".join(f"{round(255 + (c - 255) * abs(t)):02x}" for c in target)


def _heatmap(records: Records, stragglers: dict[int, dict[str, Any]]) -> str:
    timed = [r for r in records if r.get("rank_compute_s")]
    if not timed:
        return _missing("no per-rank compute times (one process, or metrics.timeline was off)")
    ranks, groups = max(len(r["rank_compute_s"]) for r in timed), _columns(timed)
    ratios = []  # [column][rank]: compute / the step's median over ranks, averaged over the column's steps
    for group in groups:
        steps = [_relative(_floats(r["rank_compute_s"]) + [math.nan] * ranks) for r in group]
        ratios.append([statistics.fmean(step[rank] for step in steps) for rank in range(ranks)])
    return _grid(
        groups,
        ratios,
        [f"rank {rank}" for rank in range(ranks)],
        set(stragglers),
        "the median",
        "compute / median of all ranks that step:",
    )


def _grid(
    groups: list[Records], ratios: list[list[float]], rows: list[str], marked: set[int], of: str, scale: str
) -> str:
    """A heat map of ratios ([column][row], 1.0 white), a column per group of steps (under the breakdown's
    bars); `marked` rows' labels in red, each cell's title '<row>, <steps>: <ratio>x <of>', and a colour
    scale headed `scale`."""
    left, top, row = 60, 8, max(2, min(22, 360 // len(rows)))
    cell, height = (WIDE - left - 12) / len(groups), top + len(rows) * row + 64
    parts = [f'<svg viewBox="0 0 {WIDE} {height}" role="img">']
    for index, label in enumerate(rows):
        if index % math.ceil(12 / row) == 0 or index in marked:
            style = ' style="fill:#c62828;font-weight:bold"' if index in marked else ""
            y = top + index * row + row / 2 + 4
            parts.append(f'<text x="{left - 6}" y="{y:.1f}" text-anchor="end"{style}>{_esc(label)}</text>')
    for index, (group, column) in enumerate(zip(groups, ratios)):
        parts += [
            f'<rect x="{left + index * cell:.1f}" y="{top + r * row}" width="{cell + 0.4:.2f}" '
            f'height="{row}" fill="{_colour(ratio)}"><title>{_esc(rows[r])}, {_steps(group)}: {ratio:.2f}x '
            f"{_esc(of)}</title></rect>"
            for r, ratio in enumerate(column)
            if math.isfinite(ratio)
        ]
    y = top + len(rows) * row + 16
    parts += _column_ticks(groups, lambda i: left + (i + 0.5) * cell, y)
    parts.append(f'<text x="{left}" y="{y + 26}">{_esc(scale)}</text>')
    for i, stop in enumerate([0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0]):
        x = left + 250 + i * 56
        parts.append(
            f'<rect x="{x}" y="{y + 14}" width="50" height="16" fill="{_colour(stop)}" stroke="#ccc"/>'
        )
        parts.append(f'<text x="{x + 25}" y="{y + 44}" text-anchor="middle">{stop:g}x</text>')
    return "".join(parts) + "</svg>"


def _expert_parallel(
    records: Records, stragglers: dict[int, dict[str, Any]], routing: dict[int, float]
) -> dict[str, tuple[str, str]]:
    """An expert-parallel run: each ep rank's routed slots over the mean of the ep ranks' over the steps, and
    a table of its experts, its load at the end and at its worst, its ranks' compute against the step's
    median and what train.log said of them; a run without expert parallelism has no such section."""
    loaded = [r for r in records if r.get("ep_rank_load_over_mean")]
    if not loaded:
        return {}
    last, groups = loaded[-1], _columns(loaded)
    ep = len(last["ep_rank_load_over_mean"])
    experts = [f"{first}-{end}" if end > first else f"{first}" for first, end in last["ep_rank_experts"]]
    ratios = [
        [
            statistics.fmean(_floats(r["ep_rank_load_over_mean"])[ep_rank] for r in group)
            for ep_rank in range(ep)
        ]
        for group in groups
    ]
    ep_of_rank = last["ep_rank_of_rank"]
    named = {ep_of_rank[rank] for rank in stragglers if rank < len(ep_of_rank)}
    heatmap = _grid(
        groups,
        ratios,
        [f"ep {ep_rank}" for ep_rank in range(ep)],
        named,
        "the mean load",
        "routed slots / mean of the ep ranks:",
    )
    timed = [_relative(_floats(r["rank_compute_s"])) for r in records if r.get("rank_compute_s")]
    rows, classes = [], []
    for ep_rank in range(ep):
        loads = [(_floats(r["ep_rank_load_over_mean"])[ep_rank], r["step"]) for r in loaded]
        worst, worst_step = max(loads)
        ranks = [rank for rank, of in enumerate(ep_of_rank) if of == ep_rank]
        compute = [
            (rank, statistics.fmean(step[rank] for step in timed if len(step) > rank))
            for rank in ranks
            if any(len(step) > rank for step in timed)
        ]
        said = [f"rank {rank}: straggler" for rank in ranks if rank in stragglers]
        said += [f"rank {rank}: {routing[rank]:.2f}x, routing imbalance" for rank in ranks if rank in routing]
        rows.append(
            [
                f"ep {ep_rank}",
                experts[ep_rank],
                _rank_list(ranks),
                f"{loads[-1][0]:.2f}x",
                f"{worst:.2f}x (step {worst_step})",
                _compute_of(compute),
                "; ".join(said),
            ]
        )
        classes.append("bad" if set(ranks) & set(stragglers) else "warn" if set(ranks) & set(routing) else "")
    head = ["ep rank", "experts", "ranks", "load, last step", "load, max", "its ranks' compute", "train.log"]
    table = _table(head, rows, classes)
    note = (
        "<p>Load: the token slots routed to its experts in every MoE layer, over all its ranks, divided by "
        "the mean of the ep ranks (1.00x is even). Compute: each of its ranks' over the median of all ranks, "
        "averaged over the logged steps. A straggler computes more than its load explains (the machine); a "
        "routing imbalance is excess compute its load explains (not named a straggler; balancing mends "
        "it, another node would not).</p>"
    )
    return {"heatmap-ep": ("Expert load per expert-parallel rank", heatmap + table + note)}


def _rank_list(ranks: list[int]) -> str:
    shown = ", ".join(str(rank) for rank in ranks[:8])
    return shown if len(ranks) <= 8 else f"{shown}, … ({len(ranks)} ranks)"


def _compute_of(compute: list[tuple[int, float]]) -> str:
    """Each rank's mean compute ratio, or, for many ranks, their mean and range."""
    if not compute:
        return "?"
    if len(compute) <= 4:
        return ", ".join(f"rank {rank} {ratio:.2f}x" for rank, ratio in compute)
    ratios = [ratio for _, ratio in compute]
    return f"mean {statistics.fmean(ratios):.2f}x, {min(ratios):.2f}-{max(ratios):.2f}x"


def _routing_imbalances(run_dir: Path) -> dict[int, float]:
    """{rank: compute ratio} of the ranks train.log reported as a routing imbalance (not named)."""
    log = run_dir / "train.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    return {int(match[1]): float(match[2]) for match in ROUTING_LINE.finditer(text)}


def _stragglers(run_dir: Path, records: Records, events: Records) -> dict[int, dict[str, Any]]:
    """{rank: {first, last, node, ratio}}: the steps metrics.jsonl lists the rank in `stragglers`, its
    node from the driver's events, and the ratio train.log gave when the rank was named (else its mean
    ratio to the step's median in metrics.jsonl)."""
    found: dict[int, dict[str, Any]] = {}

    def entry(rank: int, step: int | None) -> dict[str, Any]:
        return found.setdefault(rank, {"first": step, "last": step, "node": None, "ratio": None})

    for record in records:
        for rank in record.get("stragglers", []):
            entry(rank, record["step"])["last"] = record["step"]
    for event in events:
        if event["event"] == "straggler":
            entry(event["rank"], event.get("step"))["node"] = event.get("node")
    log = run_dir / "train.log"
    for match in STRAGGLER_LINE.finditer(log.read_text(errors="replace") if log.is_file() else ""):
        named = entry(int(match[1]), None)
        named["ratio"] = named["ratio"] or f"{float(match[2]):.2f}x its peers' median (train.log)"
    for rank, named in found.items():
        named_at = [
            _relative(_floats(r["rank_compute_s"])) for r in records if rank in r.get("stragglers", [])
        ]
        slow = [ratios[rank] for ratios in named_at if len(ratios) > rank and math.isfinite(ratios[rank])]
        if named["ratio"] is None and slow:
            named["ratio"] = f"{statistics.fmean(slow):.2f}x the step's median (metrics.jsonl)"
    return dict(sorted(found.items()))


def _table(head: list[str], rows: list[list[Any]], classes: list[str] | None = None) -> str:
    cells = ["".join(f"<td>{_esc('?' if cell is None else cell)}</td>" for cell in row) for row in rows]
    css = [f' class="{c}"' if c else "" for c in classes or [""] * len(rows)]
    th = "".join(f"<th>{_esc(cell)}</th>" for cell in head)
    return f"<table><tr>{th}</tr>" + "".join(f"<tr{c}>{row}</tr>" for c, row in zip(css, cells)) + "</table>"


def _straggler_table(stragglers: dict[int, dict[str, Any]]) -> str:
    if not stragglers:
        return _missing("no stragglers named")
    rows = [[f"rank {r}", e["first"], e["last"], e["node"] or "", e["ratio"]] for r, e in stragglers.items()]
    return _table(["rank", "first step named", "last step named", "node", "compute"], rows)


def _since(seconds: float) -> str:
    minutes, secs = divmod(seconds, 60)
    return f"+{secs:.1f} s" if not minutes else f"+{int(minutes // 60)}:{int(minutes % 60):02d}:{secs:04.1f}"


def _event_table(events: Records) -> str:
    if not events:
        return _missing("no events (not run under megascale launch)")
    rows = []
    for event in events:
        fields = {k: v for k, v in event.items() if k not in ("time", "event")}
        details = "; ".join(f"{k} {v if isinstance(v, str) else json.dumps(v)}" for k, v in fields.items())
        rows.append([_since(event["time"] - events[0]["time"]), event["event"], details[:400]])
    return _table(["time", "event", "details"], rows, [EVENT_CLASSES.get(e["event"], "") for e in events])


def _trace_link(run_dir: Path, out: Path) -> str:
    found = sessions(run_dir)
    merged = next((s / MERGED for s in reversed(found) if (s / MERGED).is_file()), None)
    if merged is not None:
        href = _esc(Path(os.path.relpath(merged.resolve(), out.resolve().parent)).as_posix())
        size_bytes = merged.stat().st_size
        size = f"{size_bytes / 1e6:.1f} MB" if size_bytes >= 1e5 else f"{size_bytes / 1e3:.1f} kB"
        text = f'<p>The merged trace: <a href="{href}">{href}</a> ({size}); open it in ui.perfetto.dev.</p>'
    elif found:
        text = (
            f"<p>No merged trace yet: run <code>megascale trace merge {_esc(run_dir)}</code>, then open "
            "the merged.json it writes in ui.perfetto.dev.</p>"
        )
    else:
        text = _missing("no traces (metrics.timeline was off)")
    hangs = [s for s in found if any((s / HANG).glob("rank-*.json"))]
    if hangs:
        text += (
            f"<p>A hang state was written in {_esc(hangs[-1].name)}: "
            f"<code>megascale trace hang {_esc(run_dir)}</code> names the culprit.</p>"
        )
    return text


def _header(run_dir: Path, records: Records, events: Records) -> str:
    if not records:
        facts = ["no steps logged"]
    else:
        first, last = records[0], records[-1]
        facts = [
            f"steps {first['step']}-{last['step']} ({len(records)} logged)",
            f"final loss {last.get('loss', math.nan):.4f}",
        ]
        facts += [f"final val loss {v:.4f}" for v in [r["val_loss"] for r in records if "val_loss" in r][-1:]]
        facts.append(f"{last['time'] - first['time']:.0f} s from the first logged step to the last")
    if events:
        faults, restarts = (sum(e["event"] == kind for e in events) for kind in ("fault", "restart"))
        facts.append(f"faults {faults}, restarts {restarts}")
    return (
        f"<header><h1>megascale report</h1><p>run directory <code>{_esc(run_dir.resolve())}</code></p>"
        f"<p>{_esc(' · '.join(facts))}</p><p>written {time.strftime('%Y-%m-%d %H:%M:%S %Z')}</p></header>"
    )
