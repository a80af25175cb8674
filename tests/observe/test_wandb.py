"""Weights & Biases as a metrics sink (observe/wandb_sink.py): an offline run directory holds the run's
config, every step's scalars as metrics.jsonl has them, and the run report; a resumed run continues the
same W&B run; nothing is left running."""

import json
import os
import struct
from pathlib import Path

import pytest

from megascale.config import load_config
from megascale.observe.metrics import read_metrics
from megascale.trainer import Trainer
from tests.conftest import tiny_args

pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402

BLOCK, HEADER = 32768, 7  # the .wandb file: LevelDB's log format, 7-byte record headers in 32 KiB blocks


def wandb_records(path: Path):
    """The protobuf records of an offline run's .wandb file, read independently of wandb's own code."""
    data = path.read_bytes()
    ident, _, _ = struct.unpack("<4sHB", data[:HEADER])
    assert ident == b":W&B"
    position, pending = HEADER, b""
    while position + HEADER <= len(data):
        left = BLOCK - position % BLOCK
        _, length, kind = struct.unpack("<IHB", data[position : position + HEADER])
        if left < HEADER or (length, kind) == (0, 0):  # the block's zero padding
            position += left
            continue
        pending += data[position + HEADER : position + HEADER + length]
        position += HEADER + length
        if kind in (1, 4):  # a whole record, or a record's last fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _history(run_dir: Path) -> tuple[dict[int, dict], dict]:
    """Every offline run's logged scalars by step, and the config they were given."""
    steps: dict[int, dict] = {}
    config = {}
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                row = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
                steps.setdefault(record.history.step.num, row)  # W&B keeps a step's first values
            elif kind == "run":
                config |= {item.key: json.loads(item.value_json) for item in record.run.config.update}
    return steps, config


def _children() -> set[int]:
    own = os.getpid()
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == own:
                found.add(int(entry.name))
    return found


def test_an_offline_run_holds_the_config_every_steps_scalars_and_the_report(tiny_corpus, tmp_path):
    before = _children()
    args = tiny_args(tiny_corpus, tmp_path / "run", tmp_path / "data", "--metrics.wandb=offline")
    Trainer(load_config(None, [*args, "--training.stop_at_step=3"])).train()
    Trainer(load_config(None, args)).train()  # resumed: the same W&B run, in a second offline directory

    steps, config = _history(tmp_path / "run")
    logged = read_metrics(tmp_path / "run")
    assert sorted(steps) == [record["step"] for record in logged] == list(range(1, 7))
    for record in logged:
        for key in ("loss", "grad_norm", "lr", "val_loss"):
            if key in record:
                assert steps[record["step"]][key] == record[key], (record["step"], key)
    assert config["model"]["dim"] == 32 and config["training"]["steps"] == 6
    runs = sorted((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({run.name.rsplit("-", 1)[1] for run in runs}) == 1  # one run id
    assert (runs[-1] / "files" / "report.html").is_file()
    assert _children() <= before  # W&B's service process ended with the run


def test_wandb_is_refused_in_one_line_without_the_package(tiny_corpus, tmp_path, monkeypatch):
    import sys

    from megascale.errors import ConfigError

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    args = tiny_args(tiny_corpus, tmp_path / "run", tmp_path / "data", "--metrics.wandb=offline")
    trainer = Trainer(load_config(None, args))
    with pytest.raises(ConfigError, match=r"metrics.wandb = 'offline' needs the wandb package: pip install"):
        trainer.train()
    trainer.close()


def test_an_offline_run_says_where_it_is_and_how_to_upload_it(tmp_path):
    import logging

    from megascale.observe.wandb_sink import WandbSink

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("megascale.observe.wandb_sink")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        sink = WandbSink(tmp_path, "offline", "megascale", None, {})
        sink.write(1, {"loss": 5.0})
        sink.close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    assert f"wandb: offline run in {run}; upload it with `wandb sync {run}`" in said
    assert list(run.glob("run-*.wandb"))
