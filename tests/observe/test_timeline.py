"""The per-rank timeline: spans, tracks that never overlap, the step's breakdown, and a real 4-process
run merged into one valid trace."""

import json
import subprocess
import sys
import threading
import time

from megascale.observe.metrics import read_metrics
from megascale.observe.timeline import WAIT, Timeline
from megascale.observe.trace import check_trace, merge_traces, read_trace
from tests.conftest import train_processes
from tests.parallel.multiprocess import run_ranks


def test_spans_reach_the_file_and_a_cut_short_file_still_reads(tmp_path):
    timeline = Timeline(tmp_path, rank=3, coords={"pp": 1, "dp": 0, "tp": 1}, flush_every_s=0.05)
    timeline.sync_clock()
    with timeline.span("forward", micro_batch=0):
        time.sleep(0.01)
    time.sleep(0.2)  # the background thread has flushed; the file has no closing bracket yet
    events = read_trace(tmp_path / "rank-00003.json")
    (forward,) = [e for e in events if e["ph"] == "X"]
    assert forward["name"] == "forward" and forward["args"] == {"micro_batch": 0} and forward["dur"] >= 10_000
    labels = next(e for e in events if e["name"] == "process_labels")
    assert labels["args"]["coords"] == {"pp": 1, "dp": 0, "tp": 1}
    timeline.close()
    assert json.loads((tmp_path / "rank-00003.json").read_text())[-1]["name"] == "trace_end"


def test_operations_in_flight_together_take_separate_lanes(tmp_path):
    timeline = Timeline(tmp_path, rank=0, coords={})
    timeline.sync_clock()
    # Completions arrive out of order from communication threads, as gloo's do.
    spans = [(0, 50), (10, 20), (25, 60), (55, 70), (70, 80)]
    threads = [
        threading.Thread(target=timeline.add_in_lane, args=("all_reduce", "comm dp", s * 1000, e * 1000, {}))
        for s, e in spans
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    timeline.close()
    events = read_trace(tmp_path / "rank-00000.json")
    assert check_trace(events) == []
    assert len([e for e in events if e["ph"] == "X"]) == len(spans)


def test_the_step_breakdown_takes_waits_out_of_compute(tmp_path):
    timeline = Timeline(tmp_path, rank=0, coords={})
    timeline.begin_step()
    ms = 1_000_000
    with timeline.span("forward"):
        timeline.add("all_gather_single", WAIT, 0, 30 * ms, {"kind": "all_gather_single"})
    timeline.add("forward", "main", 0, 100 * ms, {})  # a forward of 100 ms, 30 of them waiting
    timeline.add("wait p2p", WAIT, 0, 40 * ms, {"p2p": True})  # between stages: bubble
    timeline.add("all_reduce", WAIT, 0, 20 * ms, {"kind": "all_reduce"})
    breakdown = timeline.step.as_metrics(step_time_s=0.25, data_wait_s=0.01)
    assert abs(breakdown["compute_s"] - 0.07) < 0.01  # 100 ms of forward less the 30 ms wait inside it
    assert breakdown["comm_exposed_s"] == 0.05 and breakdown["bubble_s"] == 0.04
    assert abs(breakdown["other_s"] - (0.25 - breakdown["compute_s"] - 0.05 - 0.04 - 0.01)) < 1e-6
    timeline.close()


def spin(seconds):
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def test_on_cpu_ranks_are_compared_by_the_cpu_time_their_compute_took(tmp_path):
    """Time the OS gives other processes (here: a sleep) is in a compute phase's wall time but not in
    what the straggler detector compares."""
    timeline = Timeline(tmp_path, rank=0, coords={})
    timeline.begin_step()
    with timeline.span("forward"):
        spin(0.05)
        time.sleep(0.2)
    with timeline.span("data"):  # not compute
        spin(0.05)
    assert timeline.step.compute_s > 0.25
    assert 0.05 <= timeline.compute_busy_s() < 0.08
    timeline.close()


def test_a_four_process_run_merges_into_one_valid_trace(tiny_corpus, tmp_path):
    run_dir = train_processes(
        4,
        tiny_corpus,
        tmp_path,
        "--parallel.pp=2",
        "--parallel.dp_shard=2",
        "--training.global_batch_size=8",
        "--training.micro_batch_size=2",
        "--training.val_every=100",
    )
    merged = merge_traces(run_dir)
    trace = json.loads(merged.read_text())
    assert check_trace(trace) == []
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    for rank in range(4):
        mine = {e["name"] for e in spans if e["pid"] == rank}
        assert {"data", "forward", "backward", "clip", "optimizer", "step", "p2p"} <= mine, (rank, mine)
        assert {"all_gather_single", "reduce_scatter_single"} <= mine  # FSDP's, over dp_shard
    forwards = [e for e in spans if e["name"] == "forward" and e["pid"] == 0]
    assert {e["args"]["micro_batch"] for e in forwards} == {0, 1}  # 8 sequences / dp 2 / micro-batch 2
    groups = {e["args"]["group"] for e in spans if e.get("cat") == "comm"}
    assert {"mesh_pp", "mesh_dp_shard"} <= groups, groups
    stages = {
        e["pid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert sorted(stages.values())[0].startswith("pp 0 · dp 0 · tp 0")
    for record in read_metrics(run_dir):
        parts = sum(
            record[key] for key in ("compute_s", "comm_exposed_s", "bubble_s", "other_s", "data_wait_s")
        )
        assert abs(parts - record["step_time_s"]) < 0.01 * record["step_time_s"] + 1e-3, record


def _wait_for_a_late_peer(rank, world_size, directory):
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from megascale.observe.collectives import record_collectives

    funcol.all_gather_single(torch.ones(4), 0, dist.group.WORLD).wait()  # the first one sets up (seconds)
    dist.barrier()
    timeline = Timeline(directory, rank=rank, coords={})
    timeline.begin_step()
    record_collectives(timeline)
    if rank == 1:
        time.sleep(0.3)  # the peer is late: rank 0 waits for it where it uses the result
    gathered = funcol.all_gather_single(torch.ones(4), 0, dist.group.WORLD)  # as DTensor's TP calls it
    with timeline.span("forward"):
        total = float((gathered * 2).sum())  # first use: the wait
    record_collectives(None)
    timeline.close()
    return total, timeline.step.comm, timeline.step.compute_s


def test_tensor_parallel_waits_count_as_exposed_communication(tmp_path):
    (total, comm_s, compute_s), _ = run_ranks(_wait_for_a_late_peer, 2, tmp_path)
    assert total == 16.0
    assert comm_s > 0.2 and compute_s < 0.1  # the wait for the late peer, taken out of the forward
    events = [e for e in read_trace(tmp_path / "rank-00000.json") if e["ph"] == "X"]
    assert [e["name"] for e in events if e["name"].startswith("wait")] == ["wait all_gather_single"]
    (wait,) = [e for e in events if e["name"].startswith("wait")]
    assert wait["args"]["bytes"] == 16 and wait["dur"] > 200_000


def _wait_on_the_ring_and_between_stages(rank, world_size, directory):
    import torch
    import torch.distributed as dist

    from megascale.observe.collectives import record_collectives
    from megascale.parallel.context import _exchange

    ring = dist.new_group([0, 1], group_desc="mesh_cp")  # as ParallelDims names the cp ranks' group
    stages = dist.new_group([0, 1], group_desc="mesh_pp")
    dist.barrier()
    timeline = Timeline(directory, rank=rank, coords={})
    timeline.begin_step()
    record_collectives(timeline)
    for group in (ring, stages):
        if rank == 1:
            time.sleep(0.3)  # rank 0 waits for rank 1's keys (communication), then its stage (bubble)
        _exchange(torch.ones(4), group)
    record_collectives(None)
    timeline.close()
    return timeline.step.comm, timeline.step.bubble


def test_context_parallel_ring_waits_count_as_communication_and_pipeline_waits_as_bubble(tmp_path):
    (comm_s, bubble_s), _ = run_ranks(_wait_on_the_ring_and_between_stages, 2, tmp_path)
    assert comm_s > 0.2 and bubble_s > 0.2


def test_recording_installs_on_a_torch_without_the_single_tensor_collectives(tmp_path):
    """torch 2.11 has no `all_gather_single`/`reduce_scatter_single` (2.13's FSDP2 names): the recorder
    wraps the collectives that exist and leaves the rest out (a fresh interpreter: it installs once)."""
    script = f"""
import pathlib
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import distributed_c10d
for module in (distributed_c10d, dist, funcol):
    for name in ("all_gather_single", "reduce_scatter_single"):
        if hasattr(module, name):
            delattr(module, name)
from megascale.observe.collectives import record_collectives
from megascale.observe.timeline import Timeline
original = dist.all_reduce
timeline = Timeline(pathlib.Path({str(tmp_path)!r}), rank=0, coords={{}})
record_collectives(timeline)
assert dist.all_reduce is not original, "all_reduce not wrapped"
assert not hasattr(dist, "all_gather_single")
record_collectives(None)
timeline.close()
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_an_expert_parallel_run_names_each_ranks_experts_and_records_its_all_to_alls(tiny_corpus, tmp_path):
    run_dir = train_processes(
        2,
        tiny_corpus,
        tmp_path,
        "--model.moe.experts=4",
        "--parallel.ep=2",
        "--training.global_batch_size=8",
        "--training.micro_batch_size=2",
        "--training.val_every=100",
    )
    trace = json.loads(merge_traces(run_dir).read_text())
    assert check_trace(trace) == []
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert names[0].startswith("pp 0 · dp 0 · ep 0 · tp 0") and names[1].startswith(
        "pp 0 · dp 1 · ep 1 · tp 0"
    )
    exchanges = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == "all_to_all_single"]
    assert {e["pid"] for e in exchanges} == {0, 1}
    assert {e["args"]["group"] for e in exchanges} == {"mesh_ep"}
