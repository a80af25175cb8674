"""The driver's pure parts: non-finite step reporting, the blocklist and the events log."""

from megascale.resilience.driver import EventLog, _nonfinite_steps, evict, read_blocklist, read_events


def test_a_nonfinite_step_is_reported_once_every_rank_is_past_it_with_all_their_names():
    assert _nonfinite_steps({"0": {"step": 4, "last_nonfinite_step": 3}, "1": {"step": 2}}, 2) == {}
    assert _nonfinite_steps({"0": {"step": 4, "last_nonfinite_step": 3}}, 2) == {}  # a rank not heard yet
    both = {"0": {"step": 4, "last_nonfinite_step": 3}, "1": {"step": 3, "last_nonfinite_step": 3}}
    assert _nonfinite_steps(both, 2) == {3: [0, 1]}


def test_evicted_nodes_stay_on_the_blocklist_once(tmp_path):
    assert read_blocklist(tmp_path) == []
    evict(tmp_path, "node-1")
    assert evict(tmp_path, "node-1") == ["node-1"]
    assert evict(tmp_path, "node-3") == ["node-1", "node-3"]


def test_events_are_json_lines_with_times(tmp_path):
    log = EventLog(tmp_path)
    log.write("fault", kind="hang", node=None)
    log.write("restart", attempt=1)
    events = read_events(tmp_path)
    assert [(e["event"], e.get("kind"), e.get("attempt")) for e in events] == [
        ("fault", "hang", None),
        ("restart", None, 1),
    ]
    assert events[0]["time"] <= events[1]["time"]
