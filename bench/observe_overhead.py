"""What observing costs and what aligned garbage collection buys, each side by side in one run.

Training processes (by default two, FSDP over both, gloo) each build megascale's real `Trainer` and run
steps by hand in alternating blocks, so both modes see the same model state, data and machine noise:

- timeline: recording (phase spans, collective and wait spans, the stragglers' compute slot) against not,
  in short alternating blocks (`--timeline-block-steps`). At the end of each recording block the trace is
  flushed in the training thread and its time added to that block's last step, so the JSON encoding is
  charged to the recording mode (in a run it happens on the background thread) and none of it spills
  into the next block. The ratio is the median, over every pair of neighbouring blocks, of (time of the
  recording block / time of the silent one); the same for process CPU time (all threads). Python's
  collector runs as in a training run (`training.gc_every`): never automatically inside a step, once
  between blocks, untimed; with it on, the recording's small allocations would trigger full collections
  of the whole heap that a training run never makes.
- gc: Python's automatic collector against megascale's (`training.gc_every`: the young generations
  collected at the same step on every rank every N steps, no automatic collection). Each rank holds a
  Python heap that grows every step (`--heap` objects at start, `--grow` more per step, a little more on
  higher ranks), as a job with a large, growing Python-side state does; the automatic collector then
  walks the whole heap now and then, at different steps on different ranks. Synthetic: a plain training
  loop on CPU allocates too little for the collector to matter. Reports the mean, standard deviation and
  99th percentile of step times in each mode.

With `--device cuda --ranks 1` the timeline's spans come from device events (`torch.Event`), read by the
flush thread, never synchronising the step.
Prints one `name value` line per figure and writes them, with the machine, as JSON.

    python bench/observe_overhead.py --out bench/results/observe_overhead.json
    python bench/observe_overhead.py --device cuda --ranks 1 --parts timeline --out gpu-observe.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp

from megascale.resilience.executor import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.record, run as a script
from bench.record import save_record  # noqa: E402

MODEL = [
    "--model.dim=128",
    "--model.n_layers=4",
    "--model.attention.n_heads=4",
    "--model.attention.n_kv_heads=2",
    "--model.max_seq_len=128",
    "--data.seq_len=128",
    "--training.global_batch_size=16",
    "--training.micro_batch_size=4",
    "--checkpoint.enabled=false",
    "--metrics.progress=false",
    "--metrics.tensorboard=false",
    "--training.threads=1",
]


def rank_main(rank: int, world: int, port: int, run_dir: str, part: str, args: dict, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    import gc

    from megascale.config import load_config
    from megascale.gc_control import AlignedGC
    from megascale.observe.collectives import record_collectives
    from megascale.observe.timeline import Timeline
    from megascale.trainer import Trainer

    blocks, block_steps = args["blocks"], args["block_steps"]
    overrides = [
        *MODEL,
        f"--parallel.dp_shard={world}",
        f"--training.device={args['device']}",
        f"--training.run_dir={run_dir}",
        "--training.steps=100000",
    ]
    trainer = Trainer(load_config(overrides=overrides))
    recording, silent = trainer.timeline, Timeline.disabled()
    if part == "timeline":
        blocks, block_steps = args["timeline_blocks"], args["timeline_block_steps"]
    heap = [{"id": index, "tokens": [index]} for index in range(args["heap"] if part == "gc" else 0)]
    for _ in range(4):  # warm-up
        trainer.train_step()
    modes = ("on", "off") if part == "timeline" else ("auto", "aligned")
    times: dict[str, list[list[float]]] = {mode: [] for mode in modes}
    cpu_times: dict[str, list[list[float]]] = {mode: [] for mode in modes}
    for block in range(2 * blocks):
        mode = modes[block % 2]
        if part == "timeline":
            trainer.instruments.timeline = recording if mode == "on" else silent
            record_collectives(trainer.instruments.timeline)
            gc.disable()  # as Trainer.train runs steps (training.gc_every)
            AlignedGC.collect()
        elif mode == "auto":
            gc.enable()
        else:
            gc.disable()
        block_times, block_cpu = [], []
        for index in range(block_steps):
            heap.extend({"id": index} for _ in range(args["grow"] * (10 + rank) // 10))
            cpu_started = time.process_time()
            step_time = trainer.train_step().step_time_s
            started = time.perf_counter()
            if mode == "aligned" and index % args["gc_every"] == args["gc_every"] - 1:
                AlignedGC.collect()  # every rank at the same step: its pause is paid once, by all together
            if mode == "on" and index == block_steps - 1:
                recording.flush()  # this block's trace written now, charged to it
            block_times.append(step_time + time.perf_counter() - started)
            block_cpu.append(time.process_time() - cpu_started)
        times[mode].append(block_times)
        cpu_times[mode].append(block_cpu)
    gc.enable()
    trainer.instruments.timeline = recording
    record_collectives(None)
    recording.close()
    del heap
    if rank == 0:
        Path(out).write_text(json.dumps({"wall": times, "cpu": cpu_times}))


def run_part(part: str, args: argparse.Namespace, tmp: str) -> dict[str, dict[str, list[list[float]]]]:
    result_file = os.path.join(tmp, f"{part}.json")
    mp.start_processes(
        rank_main,
        args=(args.ranks, free_port("127.0.0.1"), os.path.join(tmp, part), part, vars(args), result_file),
        nprocs=args.ranks,
        start_method="spawn",
    )
    return json.loads(Path(result_file).read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12, help="Blocks of each mode, alternating (gc).")
    parser.add_argument("--block-steps", type=int, default=10, help="Steps per block (gc).")
    parser.add_argument("--timeline-blocks", type=int, default=60, help="Blocks of each mode (timeline).")
    parser.add_argument("--timeline-block-steps", type=int, default=3, help="Steps per block (timeline).")
    parser.add_argument("--heap", type=int, default=1_000_000, help="Python objects per rank at start (gc).")
    parser.add_argument("--grow", type=int, default=20_000, help="Python objects added per step (gc).")
    parser.add_argument("--gc-every", type=int, default=10, help="Steps between aligned collections (gc).")
    parser.add_argument("--device", default="cpu", help="training.device of every rank ('cuda': --ranks 1).")
    parser.add_argument("--ranks", type=int, default=2, help="Training processes (FSDP over all of them).")
    parser.add_argument("--parts", default="timeline,gc", help="Which of the two to run.")
    parser.add_argument("--out", type=Path, default=Path("bench/results/observe_overhead.json"))
    args = parser.parse_args()
    parts = args.parts.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        timeline = run_part("timeline", args, tmp) if "timeline" in parts else None
        collector = run_part("gc", args, tmp) if "gc" in parts else None
    figures = {}
    for clock in ("wall", "cpu") if timeline else ():
        on = [sum(block) for block in timeline[clock]["on"]]
        off = [sum(block) for block in timeline[clock]["off"]]
        ratios = [a / b for a, b in zip(on, off)] + [a / b for a, b in zip(on[1:], off)]  # both neighbours
        steps = args.timeline_block_steps
        figures[f"timeline_{clock}_step_on_s"] = round(statistics.median(on) / steps, 5)
        figures[f"timeline_{clock}_step_off_s"] = round(statistics.median(off) / steps, 5)
        figures[f"timeline_{clock}_overhead_ratio"] = round(statistics.median(ratios), 4)
    for mode, blocks in collector["wall"].items() if collector else ():
        steps = sorted(step for block in blocks for step in block)
        figures[f"gc_{mode}_step_time_mean_s"] = round(statistics.mean(steps), 5)
        figures[f"gc_{mode}_step_time_std_s"] = round(statistics.stdev(steps), 5)
        figures[f"gc_{mode}_step_time_p99_s"] = round(steps[int(0.99 * (len(steps) - 1))], 5)
    for name, value in figures.items():
        print(f"{name} {value}")
    setup = {"layout": f"dp_shard {args.ranks} (FSDP)", "model": MODEL, **vars(args)}
    save_record(args.out, figures, setup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
