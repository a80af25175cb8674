"""The README's quickstart as a new user runs it: every command line of its code blocks, in order, in a
fresh directory, each exiting 0; and every line that trains a job of its own has a run directory of its own.
Also docs/scaling-up.md's large-run config, which megascale must accept.

The lines are read from README.md, between `## Quickstart` and the next heading (the section's `### Longer`
commands take minutes to hours and are left out by that heading), not copied here. A line continued with
a backslash is joined and its comment dropped; each must be one plain `megascale` command (no shell
syntax), and is run without a shell, by megascale's CLI in a process forked from the test's (as `megascale`
would run it, without a new interpreter's start). To make the section take minutes, each
line is shortened by what its verb is, never by which line it is: training (`train`, `launch`) gets
`--training.steps=1 --training.val_sequences=8` appended (the last value of a field wins), `generate`
`--max-new-tokens 8`, `eval` `--sequences 8`; other verbs run as written.

The fresh directory holds a copy of configs/ (the quickstart runs from the repository's root) and stands in
for the home directory, with the data the README describes there: `~/my-texts`, a folder of text files (60
modules of Python's standard library), and `~/corpus/*.parquet`, Parquet files with a `content` column (the
same texts).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import sys
import sysconfig
import time
import traceback
from pathlib import Path

import pytest

from megascale.cli import _split_overrides, build_parser, main
from megascale.config import JobConfig, flatten_keys, load_config, to_dict
from megascale.parallel.dims import ParallelDims
from tests.parallel.multiprocess import renew_pools_after_fork

REPO = Path(__file__).resolve().parent.parent
SHORTER = {
    "train": ["--training.steps=1", "--training.val_sequences=8"],
    "launch": ["--training.steps=1", "--training.val_sequences=8"],
    "generate": ["--max-new-tokens", "8"],
    "eval": ["--sequences", "8"],
}
SHELL_SYNTAX = ("&&", "||", "|", ";", ">", "<", "$(", "`")


def quickstart_lines(readme: Path = REPO / "README.md") -> list[list[str]]:
    """The quickstart's command lines, in order, each split into its words as a shell would."""
    lines: list[list[str]] = []
    in_section = in_code = False
    pending = ""
    for line in readme.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            if in_section:
                break
            in_section = line.strip() == "## Quickstart"
        elif in_section and in_code:
            pending += line
            if pending.endswith("\\"):
                pending = pending[:-1]
                continue
            if words := shlex.split(pending, comments=True):
                lines.append(words)
            pending = ""
    return lines


def test_the_quickstart_is_plain_megascale_commands():
    lines = quickstart_lines()
    assert len(lines) >= 20, lines
    for words in lines:
        assert words[0] == "megascale" and not any(mark in word for word in words for mark in SHELL_SYNTAX), (
            shlex.join(words)
        )


def test_each_quickstart_line_that_trains_a_job_of_its_own_has_its_own_run_directory():
    """Jobs sharing a run directory would resume one another (another model's checkpoint is refused). The
    lines that only print or continue a run are the exceptions their comments say."""
    owners: dict[str, str] = {}
    for words in quickstart_lines():
        if words[1] not in ("train", "launch") or "--print-config" in words:
            continue
        args, extra = build_parser().parse_known_args(words[1:])
        config = REPO / args.config if args.config else None
        if config is not None and not config.is_file():
            continue  # written by an earlier line (convert --from hf): its own run_dir, runs/<folder>
        run_dir = load_config(config, _split_overrides(extra)).training.run_dir
        assert run_dir not in owners, f"{shlex.join(words)!r} trains in {run_dir}, as {owners[run_dir]!r}"
        owners[run_dir] = shlex.join(words)


def write_home(home: Path) -> None:
    """The README's `~/my-texts` (text files) and `~/corpus/*.parquet` (a `content` column) under `home`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    stdlib = Path(sysconfig.get_path("stdlib"))
    modules = sorted(path for path in stdlib.glob("*.py") if 10_000 < path.stat().st_size < 60_000)[:60]
    texts = [path.read_text(encoding="utf-8", errors="replace") for path in modules]
    (home / "my-texts").mkdir(parents=True)
    for path, text in zip(modules, texts):
        (home / "my-texts" / path.name).write_text(text)
    (home / "corpus").mkdir()
    for part in range(2):
        table = pa.table({"content": texts[part::2]})
        pq.write_table(table, home / "corpus" / f"part-{part}.parquet")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_every_quickstart_line_runs_in_order_in_a_fresh_directory(tmp_path):
    for module in ("datasets", "transformers", "wandb"):  # the [test] extra's: streaming, export, W&B
        pytest.importorskip(module)
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    write_home(tmp_path)
    took = []
    for index, words in enumerate(quickstart_lines()):
        started = time.monotonic()
        output = tmp_path / f".line-{index}.log"
        code = run_forked([*words[1:], *SHORTER.get(words[1], [])], tmp_path, output, timeout_s=600)
        took.append(f"{time.monotonic() - started:5.1f} s  {shlex.join(words)}")
        assert code == 0, f"{shlex.join(words)} exited {code}:\n{output.read_text()[-3000:]}"
    print("\n".join(took))


def run_forked(argv: list[str], home: Path, output: Path, timeout_s: float) -> int:
    """`megascale ARGV` in a child forked from this process (torch already imported: a second a line, not
    the seconds a new interpreter takes), run in `home`, which is also its home directory; its output to
    `output`; its exit status, the child killed if it outlives `timeout_s`."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.setpgid(0, 0)  # its own process group: a timeout kills the processes it started too
            fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            renew_pools_after_fork()
            os.chdir(home)
            os.environ.update(HOME=str(home), WANDB_SILENT="true")
            code = main(argv)
        except SystemExit as err:
            code = err.code if isinstance(err.code, int) else 1
        except BaseException:  # noqa: BLE001 (the parent reads the traceback from the output)
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.1)
    os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -signal.SIGKILL


def test_the_scaling_guides_config_parses_and_its_layout_fits_32_processes(tmp_path):
    """docs/scaling-up.md's large-run config (configs/llama3.1-8b.toml's model tables and the guide's
    sections) is one megascale accepts, for 4 nodes of 8; and its command lines' config fields exist."""
    guide = (REPO / "docs" / "scaling-up.md").read_text()
    sections = guide.split("```toml\n", 1)[1].split("```", 1)[0]
    model = (REPO / "configs" / "llama3.1-8b.toml").read_text().split("[data]", 1)[0]
    (tmp_path / "job.toml").write_text(model + sections)
    cfg = load_config(tmp_path / "job.toml")
    assert ParallelDims.from_config(cfg, world_size=32).describe() == "pp 1 x dp 1x32 x tp 1 = 32 processes"
    fields = flatten_keys(to_dict(JobConfig()))
    for key in re.findall(r"--([a-z_]+\.[a-z_.]+)=", guide):
        assert key in fields, f"docs/scaling-up.md: --{key} is not a config field"
