"""The run report: every section from a made-up run directory, a clear error without metrics, and the page
as headless Chromium draws it (no console errors, every chart drawn, a screenshot)."""

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import tempfile
from pathlib import Path

import pytest

from megascale.cli import main
from megascale.errors import MegascaleError
from megascale.observe.report import write_report

CHARTS = ["chart-loss", "chart-lr", "chart-grad-norm", "chart-throughput", "chart-breakdown", "heatmap-ranks"]
IDS = [*CHARTS, "table-stragglers", "table-events", "link-trace"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# No network, no first-run work, no profile outside tmp: the page must need nothing but itself.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (Debian: apt-get install chromium; .ci/run does it)"
)


def fake_run(run_dir: Path) -> Path:
    """30 logged steps of 4 ranks, rank 3 computing 1.5x the others from step 5 and named at step 12; a
    resumed attempt that logged steps 15-16 again; a fault, a restart and a recovery; a merged trace."""
    run_dir.mkdir(parents=True)
    records = []
    for step in [*range(1, 17), *range(15, 31)]:
        compute = [0.10, 0.11, 0.09, 0.15 if step >= 5 else 0.10]
        record = {
            "step": step,
            "time": 1000.0 + step,
            "loss": 5.0 - step * 0.1,
            "grad_norm": "nan" if step == 7 else 1.0 + step % 3,
            "lr": 3e-4 * min(1, step / 10),
            "tokens_per_s": 2000.0 + 10 * step,
            "step_time_s": 0.3,
            "data_wait_s": 0.01,
            "compute_s": compute[0],
            "comm_exposed_s": 0.12,
            "bubble_s": 0.05,
            "other_s": 0.02,
            "rank_compute_s": compute,
            "mfu": 0.01 + step * 1e-4,
            "peak_source": "measured",
        }
        if step >= 12:
            record["stragglers"] = [3]
        if step % 10 == 0:
            record["val_loss"] = 4.9 - step * 0.1
        if step == 16 and len(records) < 16:  # the lost attempt's step 16: replaced by the resumed one's
            record["val_loss"] = 9.9
        records.append(record)
    records[-1]["loss"] = 1.2345  # the last record of step 30
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    events = [
        ("driver", {"job": "j1", "nodes": 1}),
        ("start", {"attempt": 0, "nodes": ["node-a"], "processes": 4}),
        ("straggler", {"attempt": 0, "step": 12, "rank": 3, "node": "node-a"}),
        ("fault", {"attempt": 0, "kind": "crash", "node": "node-a", "detail": "exit 1", "last_step": 16}),
        ("stopped", {"attempt": 0, "nodes": ["node-a"]}),
        ("restart", {"attempt": 1, "checkpoint_step": 14}),
        ("recovered", {"attempt": 1, "first_step": 15, "resumed_from": 14}),
        ("done", {"attempt": 1}),
    ]
    lines = [
        json.dumps({"time": 5000.0 + 7 * i, "event": e, **fields}) for i, (e, fields) in enumerate(events)
    ]
    (run_dir / "events.jsonl").write_text("\n".join(lines) + "\n")
    (run_dir / "train.log").write_text(
        "2026-01-01 00:00:12,000 WARNING megascale.trainer: straggler: rank 3 computes 1.52x the median of "
        "its peers (0.1500 s against 0.0990 s per step over the 10 steps to step 12)\n"
    )
    for session in ("from-step-00000000", "from-step-00000014"):
        (run_dir / "traces" / session).mkdir(parents=True)
        (run_dir / "traces" / session / "rank-00000.json").write_text("[]")
    (run_dir / "traces" / "from-step-00000014" / "merged.json").write_text('{"traceEvents": []}')
    return run_dir


def section(page: str, anchor: str) -> str:
    match = re.search(rf'<section id="{anchor}"[^>]*>(.*?)</section>', page, re.S)
    assert match, f"no section {anchor}"
    return match.group(1)


def test_every_section_is_written_and_the_page_needs_nothing_from_the_network(tmp_path):
    run_dir = fake_run(tmp_path / "run")
    assert main(["report", str(run_dir)]) == 0
    page = (run_dir / "report.html").read_text()
    for anchor in IDS:
        assert page.count(f'id="{anchor}"') == 1
    for anchor in CHARTS:
        assert re.search(r"<svg[^>]*>.*<(path|rect)", section(page, anchor), re.S), anchor
    header = page[: page.index("<main>")]
    assert (
        "steps 1-30 (30 logged)" in header
        and "final loss 1.2345" in header
        and "final val loss 1.9000" in header
    )
    assert "MFU, % of the measured peak" in section(page, "chart-throughput")
    assert "grad norm non-finite at step 7" in section(page, "chart-grad-norm")
    assert section(page, "chart-loss").count("<circle") == 3  # validation at steps 10, 20, 30
    assert "9.9000" not in page
    assert "rank 3, step 20: 1.43x the median" in section(page, "heatmap-ranks")  # 0.15 s / 0.105 s
    stragglers = section(page, "table-stragglers")
    assert re.search(r"rank 3</td><td>12</td><td>30</td><td>node-a</td><td>1.52x", stragglers)
    events = section(page, "table-events")
    for kind in ("fault", "restart", "recovered", "straggler"):
        assert f"<td>{kind}</td>" in events
    assert "+0.0 s" in events and "+21.0 s" in events and "checkpoint_step 14" in events
    assert 'href="traces/from-step-00000014/merged.json"' in section(page, "link-trace")
    assert "ui.perfetto.dev" in section(page, "link-trace")
    # Self-contained: no script, stylesheet, image, font or frame is fetched, from the web or from a file.
    assert not re.search(r"<(script|link|img|iframe|object|embed)\b", page, re.I)
    assert not re.search(r"\b(src|xlink:href)\s*=|url\(|@import", page, re.I)
    assert not re.search(r"""href\s*=\s*["']?(https?:)?//""", page, re.I)


def test_a_report_elsewhere_links_the_trace_relative_to_itself(tmp_path):
    run_dir = fake_run(tmp_path / "run")
    page = write_report(run_dir, tmp_path / "pages" / "run.html").read_text()
    assert 'href="../run/traces/from-step-00000014/merged.json"' in page


def test_missing_data_is_said_in_its_section(tmp_path):
    run_dir = tmp_path / "plain"
    run_dir.mkdir()
    (run_dir / "traces" / "from-step-00000000" / "hang").mkdir(parents=True)
    (run_dir / "traces" / "from-step-00000000" / "hang" / "rank-00001.json").write_text("{}")
    records = [{"step": s, "time": 1.0 * s, "loss": 3.0, "grad_norm": 1.0, "lr": 1e-3} for s in (1, 2)]
    records += [{**records[-1], "tokens_per_s": "inf", "loss": "nan"}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    page = write_report(run_dir).read_text()
    assert "no timeline data" in section(page, "chart-breakdown")
    assert "no per-rank compute times" in section(page, "heatmap-ranks")
    assert "no stragglers named" in section(page, "table-stragglers")
    assert "no events (not run under megascale launch)" in section(page, "table-events")
    assert "no data logged" in section(page, "chart-throughput") and "no MFU" in section(
        page, "chart-throughput"
    )
    trace = section(page, "link-trace")
    assert f"megascale trace merge {run_dir}" in trace and "megascale trace hang" in trace
    assert "final loss nan" in page and "train loss non-finite at step 2" in section(page, "chart-loss")


def test_a_run_with_moe_layers_has_its_routing_charted_and_a_dense_one_has_no_routing_section(tmp_path):
    run_dir = fake_run(tmp_path / "moe")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        record.update(moe_load_max_over_mean=4.0 - 0.1 * record["step"], moe_dropped_fraction=0.02)
        record.update(moe_layer1_load_max_over_mean=2.0, moe_layer10_load_max_over_mean=3.0, moe_aux_loss=1.1)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    routing = section(write_report(run_dir).read_text(), "chart-routing")
    assert "busiest expert / mean load, worst layer" in routing and "routed slots dropped, %" in routing
    assert ">layer 1<" in routing and ">layer 10<" in routing  # one line per layer
    assert "balancing loss (mean over layers)" in routing
    assert routing.count("<path") >= 4
    assert 'id="chart-routing"' not in write_report(fake_run(tmp_path / "dense")).read_text()


def test_an_expert_parallel_run_has_its_load_per_ep_rank_beside_the_heat_map(tmp_path):
    # ep 2 over the 4 ranks: ranks 0 and 2 hold experts 0-1, whose load grows; rank 3 (experts 2-3) is
    # the fake run's straggler; rank 0's excess compute was put down to its routing in train.log.
    run_dir = fake_run(tmp_path / "ep")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        busy = 1.0 + 0.01 * record["step"]
        record.update(ep_rank_load_over_mean=[busy, 2 - busy], ep_rank_experts=[[0, 1], [2, 3]])
        record.update(ep_rank_of_rank=[0, 1, 0, 1], rank_expert_slots=[256 * busy, 0, 0, 256 * (2 - busy)])
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with (run_dir / "train.log").open("a") as log:
        log.write(
            "2026-01-01 00:00:20,000 WARNING megascale.trainer: routing imbalance: rank 0 computes 1.35x "
            "the median of its peers (0.1350 s against 0.1000 s per step over the 10 steps to step 20); "
            "its experts took 1.30x the mean load, which accounts for 1.40x (routing imbalance, not the "
            "machine): not named a straggler\n"
        )
    page = write_report(run_dir).read_text()
    assert (
        page.index('id="heatmap-ranks"') < page.index('id="heatmap-ep"') < page.index('id="table-stragglers"')
    )
    view = section(page, "heatmap-ep")
    assert "ep 0, step 20: 1.20x the mean load" in view and "ep 1, step 30: 0.70x the mean load" in view
    assert view.count("<rect") >= 2 * 30  # a cell per ep rank and step, and the colour scale
    assert re.search(r"<td>ep 0</td><td>0-1</td><td>0, 2</td><td>1.30x</td><td>1.30x \(step 30\)</td>", view)
    # Each rank's compute over the step's median, averaged over the steps (rank 3's from step 5 only 1.43x).
    assert "<td>rank 0 0.96x, rank 2 0.86x</td>" in view
    assert "<td>rank 1 1.05x, rank 3 1.37x</td><td>rank 3: straggler</td>" in view
    assert '<tr class="warn"><td>ep 0</td>' in view and "rank 0: 1.35x, routing imbalance" in view
    assert '<tr class="bad"><td>ep 1</td>' in view
    assert "rank 0" not in section(page, "table-stragglers")  # a routing imbalance names no straggler
    assert 'id="heatmap-ep"' not in write_report(fake_run(tmp_path / "dense")).read_text()


def test_a_directory_without_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(MegascaleError, match=re.escape(str(tmp_path / "metrics.jsonl"))):
        write_report(tmp_path)
    assert main(["report", str(tmp_path / "nowhere")]) == 2


def run_chromium(args: list[str], profile: Path, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """Chromium with `args`, in its own process group so that a timeout ends every process it started."""
    command = [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def screenshot(page: Path, png: Path, width: int = 1400, height: int = 2400) -> Path:
    """A PNG of `page` as Chromium draws it (docs/report.png is made with this)."""
    png.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        args = [f"--screenshot={png.resolve()}", f"--window-size={width},{height}", page.resolve().as_uri()]
        done = run_chromium(args, Path(profile))
    assert png.is_file(), f"chromium wrote no screenshot: {done.stderr[-2000:]}"
    return png


# Appended to a copy of the page: after layout, each section records how many SVG shapes it draws with a
# non-empty box, and a console line proves that console output reaches us.
PROBE = """<script>
for (const s of document.querySelectorAll("section")) {
  const drawn = [...s.querySelectorAll("svg path, svg rect, svg circle")].filter(e => {
    const box = e.getBBox(); return box.width > 0 || box.height > 0; });
  s.dataset.drawn = drawn.length;
}
console.log("megascale-probe-ran");
</script>"""


@needs_chromium
def test_chromium_draws_every_chart_without_console_errors(tmp_path):
    page = write_report(fake_run(tmp_path / "run")).read_text()
    probed = tmp_path / "run" / "probed.html"
    probed.write_text(page.replace("</body>", PROBE + "</body>"))
    # Console messages: with --enable-logging=stderr --v=0 Chromium prints every console message (log,
    # warning, error, uncaught exception alike) as an `INFO:CONSOLE...] "text", source: URL (line)` line
    # on stderr; headless has no DevTools to ask instead. The probe's own line shows the channel works, so
    # "no other line from this page" is a real check, not a quiet pipe.
    done = run_chromium(
        ["--enable-logging=stderr", "--v=0", "--dump-dom", probed.as_uri()], tmp_path / "profile"
    )
    console = [line for line in done.stderr.splitlines() if "CONSOLE" in line and probed.as_uri() in line]
    assert any('"megascale-probe-ran"' in line for line in console), done.stderr[-3000:]
    assert [line for line in console if "megascale-probe-ran" not in line] == []
    dom = done.stdout
    for anchor in IDS:
        assert f'id="{anchor}"' in dom
    for anchor in CHARTS:
        drawn = re.search(rf'<section id="{anchor}"[^>]*data-drawn="(\d+)"', dom)
        # The axes and a legend swatch are two; a third shape is data.
        assert drawn and int(drawn.group(1)) >= 3, f"{anchor} draws nothing: {drawn and drawn.group(0)}"


@needs_chromium
def test_a_screenshot_of_the_page(tmp_path):
    png = screenshot(write_report(fake_run(tmp_path / "run")), tmp_path / "report.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", data[16:24]) == (1400, 2400)
    assert len(data) > 50_000  # charts, not a blank page (a blank 1400x2400 PNG is a few KB)
