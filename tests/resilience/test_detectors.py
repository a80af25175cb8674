"""The driver's pure parts: its detectors on made-up series, the blocklist and the events log."""

from megascale.observe.events import EventLog, read_events
from megascale.resilience.detectors import FlatCounter, LossSpike, StepTimeCollapse, nonfinite_steps
from megascale.resilience.records import evict, read_blocklist


def test_a_nonfinite_step_is_reported_once_every_rank_is_past_it_with_all_their_names():
    assert nonfinite_steps({"0": {"step": 4, "last_nonfinite_step": 3}, "1": {"step": 2}}, 2) == {}
    assert nonfinite_steps({"0": {"step": 4, "last_nonfinite_step": 3}}, 2) == {}  # a rank not heard yet
    both = {"0": {"step": 4, "last_nonfinite_step": 3}, "1": {"step": 3, "last_nonfinite_step": 3}}
    assert nonfinite_steps(both, 2) == {3: [0, 1]}


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
    with open(tmp_path / "events.jsonl", "a") as file:
        file.write('{"time": 1, "event": "fau')  # the driver died mid-line
    assert len(read_events(tmp_path)) == 2


def test_a_loss_spike_is_found_by_its_z_score_over_the_window():
    detector = LossSpike(z=6.0, window=20)
    noisy = [3.0 + 0.01 * ((step * 7) % 5 - 2) for step in range(20)]
    assert [detector.observe(step, loss) for step, loss in enumerate(noisy)] == [None] * 20
    assert detector.observe(20, 3.05) is None  # 3.5 standard deviations: ordinary
    spike = detector.observe(21, 3.5)
    assert spike is not None and spike["step"] == 21 and spike["z"] > 6
    assert detector.observe(22, 3.5) is not None  # the spike stayed out of the history


def test_no_loss_spike_is_judged_before_half_a_window_or_on_a_flat_history():
    detector = LossSpike(z=6.0, window=20)
    assert [detector.observe(step, 3.0 + step % 2 * 0.01) for step in range(9)] == [None] * 9
    assert detector.observe(9, 100.0) is None  # 9 readings: too few to judge
    flat = LossSpike(z=6.0, window=4)
    assert [flat.observe(step, 3.0) for step in range(5)] == [None] * 5
    assert LossSpike(z=0.0, window=4).observe(0, 1.0) is None  # z = 0 turns it off


def test_step_time_collapse_needs_several_slow_steps_in_a_row():
    detector = StepTimeCollapse(factor=3.0, window=10, persist=3)
    for step in range(10):
        assert detector.observe(step, 1.0 + 0.01 * step) is None
    assert detector.observe(10, 5.0) is None  # a checkpoint step
    assert detector.observe(11, 1.0) is None  # back to normal: the count starts again
    assert [detector.observe(step, 4.0) for step in (12, 13)] == [None, None]
    found = detector.observe(14, 4.0)
    assert found == {"step": 14, "step_time_s": 4.0, "median_s": detector_median(detector)}
    assert detector.observe(15, 4.0) is None  # reported once per episode


def detector_median(detector):
    import statistics

    return statistics.median(detector.history)


def test_a_flat_counter_reports_how_long_it_has_not_moved():
    counter = FlatCounter()
    assert counter.observe(100.0, 5) == 0.0
    assert counter.observe(101.5, 5) == 1.5
    assert counter.observe(102.0, 9) == 0.0
    assert counter.observe(110.0, 9) == 8.0


def test_an_anomaly_is_an_event_with_warn_and_a_fault_with_restart(tmp_path):
    from megascale.config import load_config
    from megascale.resilience.driver import Driver
    from megascale.resilience.watch import AttemptWatch

    progress = {str(rank): {"step": 9, "loss": 9.0, "step_time_s": 0.1} for rank in range(2)}
    beats = {"node-0": {"progress": progress}}
    for action, expect_fault in (("warn", False), ("restart", True)):
        cfg = load_config(overrides=[f"--resilience.anomaly_action={action}"])
        run_dir = tmp_path / action
        run_dir.mkdir()
        watch = AttemptWatch(Driver(cfg, [], run_dir), ["node-0"], attempt=0)
        watch.loss_spike, watch.slow_steps = LossSpike(z=6.0, window=8), StepTimeCollapse(3.0, 8)
        for step in range(8):
            watch.loss_spike.observe(step, 3.0 + 0.01 * (step % 3))
        fault = watch._anomalies(9, beats)
        (event,) = read_events(run_dir)
        assert event["event"] == "loss_spike" and event["action"] == action and event["step"] == 9
        assert (fault is not None) == expect_fault
        if fault is not None:
            assert fault.kind == "loss_spike" and fault.last_progress_step == 9


def test_a_straggler_is_a_fault_on_its_node_only_when_asked_and_a_spare_is_free(tmp_path):
    from megascale.config import load_config
    from megascale.resilience.driver import Driver
    from megascale.resilience.watch import AttemptWatch

    def progress(ranks, stragglers):
        return {
            str(r): {"step": 30, "loss": 3.0, "step_time_s": 0.1, "stragglers": stragglers} for r in ranks
        }

    beats = {"node-0": {"progress": progress([0, 1], [2])}, "node-1": {"progress": progress([2, 3], [2])}}
    for evict_stragglers, healthy, expect_fault in (
        (False, ["node-0", "node-1", "node-2"], False),
        (True, ["node-0", "node-1"], False),  # no spare: the job goes on with its straggler
        (True, ["node-0", "node-1", "node-2"], True),
    ):
        run_dir = tmp_path / f"{evict_stragglers}-{len(healthy)}"
        run_dir.mkdir()
        cfg = load_config(overrides=[f"--resilience.evict_stragglers={str(evict_stragglers).lower()}"])
        driver = Driver(cfg, [], run_dir)
        driver.healthy_nodes = lambda healthy=healthy: healthy
        watch = AttemptWatch(driver, ["node-0", "node-1"], attempt=0)
        watch.loss_spike, watch.slow_steps = LossSpike(z=6.0, window=8), StepTimeCollapse(3.0, 8)
        fault = watch._anomalies(30, beats)
        (event,) = read_events(run_dir)
        assert event["event"] == "straggler" and event["rank"] == 2 and event["node"] == "node-1"
        assert (fault is not None) == expect_fault
        if fault is not None:
            assert (fault.kind, fault.node, fault.extra) == ("straggler", "node-1", {"rank": 2})


def test_a_save_waiting_for_a_dead_nodes_share_is_abandoned_and_the_driver_goes_on(tmp_path):
    import time

    from megascale.checkpoint.persist import abandon_marker
    from megascale.config import load_config
    from megascale.resilience.driver import Driver

    final = tmp_path / "checkpoints" / "step-00000008"
    final.mkdir(parents=True)

    class Beats:
        """node-0 coordinates save s8 until it is abandoned; node-1 has nothing left to persist."""

        back_at = 0.0  # no store outage

        def fetch(self, key):
            waiting = not (final / abandon_marker("s8")).exists()
            coordinator = {"snapshots_pending": 1, "snapshot_waiting": {"final": str(final), "save_id": "s8"}}
            beat = coordinator if key == "hb/node-0" and waiting else {"snapshots_pending": 0}
            return {"time": time.time(), **beat}

    cfg = load_config(overrides=["--resilience.heartbeat_interval_s=0.1"])
    driver = Driver(cfg, [], tmp_path)
    driver.store = Beats()
    started = time.monotonic()
    driver.wait_for_snapshots(["node-0", "node-1"], timeout_s=30)
    assert time.monotonic() - started < 5
    (event,) = read_events(tmp_path)
    assert event["event"] == "abandoned" and event["checkpoint"] == str(final)


class Beats:
    """The driver's view of the store: each node's heartbeat, as a test sets it."""

    back_at = 0.0  # no store outage

    def __init__(self, beats):
        self.beats = beats

    def fetch(self, key):
        return self.beats.get(key.removeprefix("hb/"))


def exited(node, at, signalled=None, exit_code=1):
    now = 1e12  # far ahead: no heartbeat is ever stale
    return {"time": now, "node": node, "attempt": 0, "state": "exited", "exit_code": exit_code,
            "exited_at": at, "signalled": signalled or {}, "progress": {}, "errors": []}  # fmt: skip


def test_a_fault_is_put_on_the_node_a_signal_struck_not_on_the_first_in_the_list(tmp_path):
    """Rank 3 on host-b is SIGKILLed; its peers on host-a fail on the lost connection and report in the
    same poll, or earlier: the fault is host-b's (it was host-a's, by list order, and failed in CI)."""
    from megascale.config import load_config
    from megascale.resilience.driver import Driver

    cfg = load_config(overrides=["--resilience.heartbeat_interval_s=0.01"])
    driver = Driver(cfg, [], tmp_path)
    driver.store = Beats(
        {
            "host-a": exited("host-a", at=100.0),
            "host-b": exited("host-b", at=100.4, signalled={"3": "SIGKILL"}),
        }
    )
    fault = driver.watch(["host-a", "host-b"], attempt=0)
    assert (fault.kind, fault.node) == ("process_exit", "host-b")
    assert fault.extra["signalled_ranks"] == {"3": "SIGKILL"} and fault.extra["also_failed"] == ["host-a"]


def test_without_a_primary_signal_the_fault_is_the_first_node_to_exit(tmp_path):
    from megascale.config import load_config
    from megascale.resilience.driver import Driver

    cfg = load_config(overrides=["--resilience.heartbeat_interval_s=0.01"])
    driver = Driver(cfg, [], tmp_path)
    # host-a's workers were ended by torchrun (SIGTERM) after host-b's failed with an exception.
    beats = {"host-a": exited("host-a", 100.3, {"0": "SIGTERM"}), "host-b": exited("host-b", 100.0)}
    driver.store = Beats(beats)
    fault = driver.watch(["host-a", "host-b"], attempt=0)
    assert (fault.kind, fault.node, fault.extra["also_failed"]) == ("process_exit", "host-b", ["host-a"])
