"""ETTR from a run's records: the steps that count, the time spent on them, and the chart."""

from megascale.observe.goodput import ettr, final_curve, progress_chart


def record(step, time, step_time_s=0.5):
    return {"step": step, "time": time, "loss": 1.0, "step_time_s": step_time_s}


def test_the_time_of_steps_redone_and_of_the_outage_does_not_count():
    """Attempt 0 trains steps 1-4 a second apart, dies; attempt 1 starts 10 s later, redoes steps 3-4
    from the snapshot of step 2 and trains on to step 6. The steps that count are the last record of each
    number: 1-2 from attempt 0, 3-6 from attempt 1; the start-up, the outage and the first try at 3-4 do
    not count."""
    events = [{"event": "start", "time": 100.0}, {"event": "start", "time": 115.0}]
    records = [record(step, 101.0 + step) for step in range(1, 5)]  # 102 .. 105
    records += [record(step, 114.0 + step) for step in range(3, 7)]  # 117 .. 120
    assert sorted(final_curve(records)) == [1, 2, 3, 4, 5, 6]
    result = ettr(records, events, began=100.0, ended=121.0)
    # step 1: its own 0.5 s; step 2: 1 s after step 1; step 3 (first of attempt 1): 0.5 s; 4-6: 1 s each.
    assert result["productive_s"] == 0.5 + 1.0 + 0.5 + 3.0 and result["wall_s"] == 21.0
    assert abs(result["ettr"] - 5.0 / 21.0) < 1e-12


def test_the_chart_marks_every_fault_and_keeps_a_drop_when_it_thins_the_points():
    records = [record(step, float(step)) for step in range(1, 9001)] + [record(10, 9100.0)]
    svg = progress_chart(records, [{"time": 4000.0, "fault": "rank SIGKILL"}], began=0.0)
    assert svg.startswith("<svg") and svg.count("<line") == 1 and "rank SIGKILL at 4000 s" in svg
    assert svg.count("L") < 4000  # thinned to a few thousand points


def test_the_run_report_of_a_soak_shows_its_goodput_chart(tmp_path):
    import json

    from megascale.observe.report import write_report

    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(record(step, 100.0 + step)) + "\n" for step in range(1, 30))
    )
    faults = [{"time": 110.2, "fault": "rank SIGSTOP"}, {"time": 120.5, "fault": "executor kill"}]
    (tmp_path / "soak.json").write_text(json.dumps({"ettr": 0.912, "began": 100.0, "faults": faults}))
    page = write_report(tmp_path).read_text()
    assert "Goodput under 2 faults: ETTR 91.2%" in page and "rank SIGSTOP at 10 s" in page
