"""Reading /proc/stat: busy and stolen shares between two readings, and a window looked up afterwards."""

from megascale.observe import cpu_load
from megascale.observe.cpu_load import (
    CpuSampler,
    CpuTimes,
    busy_fraction,
    cpu_times,
    least_disturbed,
    steal_fraction,
)


def stat_line(user, idle, iowait, steal):
    #      user  nice system idle iowait irq softirq steal guest guest_nice
    return f"cpu  {user} 0 0 {idle} {iowait} 0 0 {steal} 7 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"


def test_steal_and_busy_shares_come_from_the_first_line_of_proc_stat(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    monkeypatch.setattr(cpu_load, "PROC_STAT", stat)
    stat.write_text(stat_line(user=100, idle=50, iowait=10, steal=40))
    before = cpu_times()
    assert before == CpuTimes(total=200, idle=60, steal=40)  # guest time is inside user time: not added
    stat.write_text(stat_line(user=160, idle=70, iowait=10, steal=60))  # +60 busy, +20 idle, +20 stolen
    after = cpu_times()
    assert steal_fraction(before, after) == 0.2 and busy_fraction(before, after) == 0.6
    assert steal_fraction(after, after) == 0.0  # no time passed: nothing to divide


def test_without_proc_stat_nothing_is_stolen(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_load, "PROC_STAT", tmp_path / "absent")
    assert steal_fraction(cpu_times(), cpu_times()) == 0.0


def test_a_window_is_measured_from_the_readings_around_it():
    sampler = CpuSampler()
    sampler.samples = [
        (10.0, CpuTimes(0, 0, 0)),
        (11.0, CpuTimes(100, 0, 0)),
        (12.0, CpuTimes(200, 0, 50)),  # half of this second stolen
        (13.0, CpuTimes(300, 0, 50)),
    ]
    assert sampler.steal_between(11.0, 12.0) == 0.5
    assert sampler.steal_between(11.5, 12.5) == 0.25  # widened to the readings at 11 and 13
    assert sampler.steal_between(0.0, 99.0) == 50 / 300  # beyond the samples: all of them
    # Steps logged at their end: one from 11.0 to 11.6, the next ending at 12.0.
    steps = [{"time": 11.6, "step_time_s": 0.6}, {"time": 12.0, "step_time_s": 0.4}]
    assert sampler.steal_over_steps(steps) == 0.5


def test_the_sampler_reads_in_a_thread_until_it_is_left():
    with CpuSampler(interval_s=0.01) as sampler:
        while len(sampler.samples) < 3:
            pass
    count = len(sampler.samples)
    assert count >= 4  # and one last reading as it stops
    assert all(a[0] <= b[0] for a, b in zip(sampler.samples, sampler.samples[1:]))
    assert len(sampler.samples) == count  # stopped


def test_least_disturbed_measures_until_enough_are_calm_and_keeps_the_calmest():
    def measurements(steals):
        readings = iter(steals)
        return lambda: next(readings)

    calm_third_and_fourth = measurements([0.2, 0.01, 0.3, 0.02, 0.0])
    assert least_disturbed(calm_third_and_fourth, lambda s: s, wanted=2, most=5, quiet=0.05) == (
        [0.01, 0.02],
        4,
    )
    never_calm = measurements([0.2, 0.1, 0.3, 0.0])
    assert least_disturbed(never_calm, lambda s: s, wanted=2, most=3, quiet=0.05) == ([0.1, 0.2], 3)
