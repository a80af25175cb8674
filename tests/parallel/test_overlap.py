"""Communication overlap (parallel.overlap.*) changes when communication happens, never what is computed:
the Trainer's losses with each overlap on and off, and the pipeline's sends and receives decoupled."""

import json

import pytest

from megascale.config import OverlapConfig, load_config
from megascale.observe.metrics import read_metrics
from megascale.observe.trace import read_trace
from megascale.trainer import Trainer
from tests.conftest import TINY
from tests.parallel.multiprocess import run_ranks

STEPS = 10
# Four layers, so that two pipeline ranks can hold two virtual stages each; 4 sequences per step.
JOB = [
    "--model.n_layers=4",
    "--training.global_batch_size=4",
    f"--training.steps={STEPS}",
    f"--training.val_every={STEPS}",
    "--optim.grad_clip=0.5",
    "--checkpoint.enabled=false",
]
# Per rank, 4 blocks x tp_chunks chunks x 2 micro-batches, in the MLP and around attention: as many
# all-gathers per forward as per backward over 10 steps, and a forward's more in the one validation.
TP_GATHERS_PER_PASS = 4 * OverlapConfig().tp_chunks * 2 * 2
TP_GATHERS = STEPS * 2 * TP_GATHERS_PER_PASS + TP_GATHERS_PER_PASS
# Two micro-batches per rank and step, gradients reduce-scattered once, at the second.
ZERO1_ACCUMULATING = ["--parallel.zero_stage=1", "--training.micro_batch_size=1"]
ZERO2_ACCUMULATING = ["--parallel.zero_stage=2", "--training.micro_batch_size=1"]  # reduced at each
EVERY_OVERLAP = ("parallel.overlap.tp", "parallel.overlap.dp", "parallel.overlap.pp")
INTERLEAVED = [
    "--parallel.pp=2",
    "--parallel.pp_schedule=interleaved_1f1b",
    "--parallel.pp_virtual_stages=2",
    "--training.micro_batch_size=1",
]


def job_args(corpus, data_dir, run_dir, *layout):
    return [
        *TINY,
        *JOB,
        f"--data.source={corpus}",
        f"--data.cache_dir={data_dir}",
        f"--training.run_dir={run_dir}",
        *layout,
    ]


def train_both_ways(rank, world_size, corpus, data_dir, run_root, layout, switch):
    """Train `layout` with `switch` (an overlap flag, or "all" of them) on, then off: both runs' losses
    (rank 0) and whether any of this rank's pipeline p2p batches held a send and a receive together."""
    result = {}
    switches = EVERY_OVERLAP if switch == "all" else (switch,)
    for value in ("true", "false"):
        run_dir = run_root / value
        flags = [f"--{name}={value}" for name in switches]
        args = job_args(corpus, data_dir, run_dir, *layout, *flags)  # 10 steps
        Trainer(load_config(None, args)).train()
        events = [e for p in run_dir.glob(f"traces/*/rank-{rank:05d}.json") for e in read_trace(p)]
        p2p = {e["args"]["ops"] for e in events if e.get("name") == "p2p" and e["ph"] == "X"}
        if rank == 0:
            result[value] = [r["loss"] for r in read_metrics(run_dir)]
        result.setdefault("mixed", {})[value] = any("send" in ops and "recv" in ops for ops in p2p)
        overlap_waits = [  # the overlap's own gathers: not DTensor's functional ones, on the same group
            e["name"]
            for e in events
            if e["ph"] == "X"
            and e["name"].startswith("wait ")
            and e["args"].get("group") == "mesh_tp"
            and not e["args"].get("functional")
        ]
        result.setdefault("tp_gathers_waited", {})[value] = overlap_waits.count("wait all_gather_single")
        # A blocking collective's time on the wait track bears its own name; an asynchronous one's "wait ...".
        on_wait_track = [
            e["name"]
            for e in events
            if e["ph"] == "X" and e.get("cat") == "wait" and "dp" in e["args"].get("group", "")
        ]
        result.setdefault("reduce_scatters", {})[value] = {
            "async": on_wait_track.count("wait reduce_scatter_single"),
            "blocking": on_wait_track.count("reduce_scatter_single"),
        }
    return result


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, world_size, layout, switch",
    [
        ("tp2 tp", 2, ["--parallel.tp=2", "--training.micro_batch_size=2"], "parallel.overlap.tp"),
        ("dp2xtp2 dp", 4, ["--parallel.dp_shard=2", "--parallel.tp=2"], "parallel.overlap.dp"),
        ("dp2 zero1 dp", 2, ["--parallel.dp_shard=2", *ZERO1_ACCUMULATING], "parallel.overlap.dp"),
        (
            "dp2 zero2 accumulating dp",
            2,
            ["--parallel.dp_shard=2", *ZERO2_ACCUMULATING],
            "parallel.overlap.dp",
        ),
        ("pp2 1f1b pp", 2, ["--parallel.pp=2", "--training.micro_batch_size=1"], "parallel.overlap.pp"),
        # In lock-step, each stage's data-parallel gradients reduced as the decoupled runtime does.
        ("dp2xpp2 interleaved pp", 4, ["--parallel.dp_shard=2", *INTERLEAVED], "parallel.overlap.pp"),
        # The two layouts with every overlap on against every overlap off.
        ("dp2xtp2 all", 4, ["--parallel.dp_shard=2", "--parallel.tp=2"], "all"),
        ("tp2xpp2 interleaved all", 4, ["--parallel.tp=2", *INTERLEAVED], "all"),
    ],
)
def test_an_overlap_changes_no_loss(name, world_size, layout, switch, tiny_corpus, tmp_path):
    results = run_ranks(
        train_both_ways, world_size, tiny_corpus, tmp_path / "data", tmp_path, layout, switch, timeout_s=400
    )
    on, off = results[0]["true"], results[0]["false"]
    delta = max(abs(a - b) for a, b in zip(on, off))
    print(f"{name}: {STEPS} steps, max |delta loss| overlap on vs off = {delta:.2e}")
    assert len(on) == len(off) == STEPS
    if switch in ("parallel.overlap.tp", "all"):  # GEMMs over sequence chunks: the same sums, blocked
        assert delta <= 1e-6  # differently
        # All-gathers issued ahead and waited on; without the overlap DTensor's blocking ones instead.
        waited = [r["tp_gathers_waited"] for r in results]
        print("TP all-gathers waited on per rank:", [w["true"] for w in waited])
        assert all(w["false"] == 0 for w in waited)
        if name == "tp2 tp":  # counted for this layout
            assert all(w["true"] == TP_GATHERS for w in waited)
        else:
            assert all(w["true"] > 0 for w in waited)
    else:
        assert on == off  # bit for bit: the same reductions in the same order
    if switch == "parallel.overlap.dp":
        # One reduce-scatter per FSDP unit (4 blocks and the root), step and synchronised micro-batch:
        # asynchronous with the overlap, blocking without; blocking too where FSDP2 adds the result to an
        # earlier micro-batch's gradients at once.
        print("gradient reduce-scatters per rank:", [r["reduce_scatters"] for r in results])
        later = 5 * STEPS if "accumulating" in name else 0  # the second micro-batch's
        assert all(r["reduce_scatters"]["true"] == {"async": 5 * STEPS, "blocking": later} for r in results)
        assert all(
            r["reduce_scatters"]["false"] == {"async": 0, "blocking": 5 * STEPS + later} for r in results
        )
    if switch == "parallel.overlap.pp" or (switch == "all" and "--parallel.pp=2" in layout):
        # Decoupled: no rank ever waits on a send and a receive as one batch; in lock-step some do.
        assert not any(r["mixed"]["true"] for r in results)
        assert any(r["mixed"]["false"] for r in results)
    if name == "dp2xpp2 interleaved pp":
        # Under the pipeline schedule FSDP reduce-scatters once a step, though each rank runs two
        # micro-batches: per rank its two blocks' units and the stage root that holds the embedding or the
        # final norm and output layer (megascale.plan.step prices data parallelism so).
        assert all(
            r["reduce_scatters"][v] == {"async": 0, "blocking": 3 * STEPS}
            for r in results
            for v in r["mixed"]
        )


@pytest.mark.slow
def test_two_hundred_interleaved_steps_with_every_overlap_on_finish(tiny_corpus, tmp_path):
    layout = [*INTERLEAVED, "--training.steps=200", "--training.log_every=50", "--training.val_every=1000"]
    args = job_args(tiny_corpus, tmp_path / "data", tmp_path / "run", *layout, "--checkpoint.enabled=false")
    summaries = run_ranks(_train, 2, args, timeout_s=400)
    assert [s["step"] for s in summaries] == [200, 200]
    print(json.dumps({"steps": 200, "final_loss": summaries[0]["loss"]}))


def _train(rank, world_size, args):
    cfg = load_config(None, args)
    assert cfg.parallel.overlap.dp and cfg.parallel.overlap.pp  # the defaults: every overlap on
    return Trainer(cfg).train()
