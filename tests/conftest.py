"""Shared fixtures: a tiny text corpus, a tiny job config that trains in seconds on CPU, and two emulated
hosts (network namespaces on this machine); and how tests share the machine when pytest-xdist runs them
two at a time (pyproject.toml's addopts)."""

import fcntl
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from bench.netem import EmulatedNodes
from megascale.config import load_config

# -- sharing the machine ------------------------------------------------------------------------------------
# The suite runs on two pytest-xdist workers: most tests leave a core idle (one process, one thread) or wait
# on timeouts and restarts, so two at a time finish sooner. A test marked `alone` times itself against the
# machine (a detection delay, a ratio of paces, a goodput floor) and runs with no other test beside it: it
# takes a file lock exclusively, every other test takes it shared. A turnstile lock in front keeps a stream
# of shared takers from starving an exclusive one. Tests that share a module- or session-scoped fixture
# carry an `xdist_group` mark, so one worker builds it once.
LOCK_ENV = "MEGASCALE_TEST_LOCK"


def pytest_configure(config):
    if hasattr(config, "workerinput"):
        return  # a worker: the controller made the lock and the environment carries its path
    handle, path = tempfile.mkstemp(prefix="megascale-tests-", suffix=".lock")
    os.close(handle)
    os.environ[LOCK_ENV] = path
    config.add_cleanup(lambda: [Path(name).unlink(missing_ok=True) for name in (path, path + ".turnstile")])


def pytest_collection_modifyitems(config, items):
    """Under xdist, the longest first, so that the short ones fill in at the end: a test that sets itself
    a longer timeout than the suite's, then the slow ones (xdist puts the groups before either)."""

    def longest_first(item):
        timeout = item.get_closest_marker("timeout")
        seconds = timeout.args[0] if timeout and timeout.args else 0
        return (-seconds, item.get_closest_marker("slow") is None)

    if hasattr(config, "workerinput"):
        items.sort(key=longest_first)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The whole test, its fixtures' setup and teardown included, under the machine's lock."""
    path = os.environ.get(LOCK_ENV)
    if path is None:
        yield
        return
    alone = item.get_closest_marker("alone") is not None
    with open(path, "a") as machine, open(path + ".turnstile", "a") as turnstile:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)


TINY = [
    "--model.dim=32",
    "--model.n_layers=2",
    "--model.attention.n_heads=4",
    "--model.attention.n_kv_heads=2",
    "--model.max_seq_len=32",
    "--data.seq_len=32",
    "--data.val_fraction=0.1",
    "--training.global_batch_size=4",
    "--training.micro_batch_size=2",
    "--training.steps=6",
    "--training.val_every=3",
    "--training.val_sequences=4",
    "--training.log_every=1",
    "--training.peak_tflops=0.1",
    "--optim.warmup_steps=2",
    "--checkpoint.every=3",
    "--metrics.progress=false",
    "--metrics.tensorboard=false",
]


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Keep calibration and dataset caches out of the user's home."""
    monkeypatch.setenv("MEGASCALE_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="session", autouse=True)
def _session_staging(tmp_path_factory):
    """The same for module- and session-scoped fixtures, which run before any test's own setting."""
    base = tmp_path_factory.getbasetemp()
    places = {"MEGASCALE_STAGING_DIR": base / "staging", "MEGASCALE_STAGING_BASE": base / "shm"}
    saved = {name: os.environ.get(name) for name in places}
    os.environ.update({name: str(path) for name, path in places.items()})
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def _isolated_staging(tmp_path, monkeypatch):
    """Checkpoint snapshots and staging go under the test's directory, not the machine's /dev/shm, so a
    test that stops short (as a crash would) leaves nothing in memory behind it, and what a test finds
    left in its staging base is its own, not a test's running beside it."""
    monkeypatch.setenv("MEGASCALE_STAGING_DIR", str(tmp_path / "staging"))
    monkeypatch.setenv("MEGASCALE_STAGING_BASE", str(tmp_path / "shm"))


@pytest.fixture(autouse=True)
def _isolated_logging():
    """A Trainer built in one test sets up megascale's logger (its own handlers, no propagation); put it
    back afterwards so the next test's caplog sees records and no file handler outlives its run."""
    logger = logging.getLogger("megascale")
    saved = (list(logger.handlers), logger.propagate, logger.level)
    yield
    for handler in logger.handlers:
        if handler not in saved[0]:
            handler.close()
    logger.handlers[:], logger.propagate, logger.level = saved


@pytest.fixture(autouse=True)
def _no_threads_left_behind():
    """A test leaves no megascale thread running: a Trainer or loader it built is closed. A thread left in
    the test process also travels into every rank that multiprocess.run_ranks forks later, mid-whatever it
    was doing."""
    before = set(threading.enumerate())
    yield
    left = [
        thread.name for thread in set(threading.enumerate()) - before if thread.name.startswith("megascale-")
    ]
    assert not left, f"threads left running: {left} (close the Trainer or loader the test built)"


def write_tiny_corpus(root):
    """60 small deterministic text files (~100 KB) in the directory `root`, created; returns it."""
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "value", "data", "x", "="]
    for i in range(60):
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(40)]
        (root / f"doc{i:03d}.txt").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A directory of 60 small deterministic text files (~100 KB)."""
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus"))


def tiny_args(corpus, run_dir, cache_dir, *extra):
    return [
        *TINY,
        f"--data.source={corpus}",
        f"--data.cache_dir={cache_dir}",
        f"--training.run_dir={run_dir}",
        *extra,
    ]


def train_processes(nproc, corpus, tmp_path, *extra, timeout=300):
    """`megascale train --nproc N` of the tiny job in tmp_path/run (data cached in tmp_path/data), failing
    the test if it fails; the run directory."""
    run_dir = tmp_path / "run"
    args = tiny_args(corpus, run_dir, tmp_path / "data", *extra)
    command = [sys.executable, "-m", "megascale.cli", "train", "--nproc", str(nproc), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.fixture
def tiny_config(tiny_corpus, tmp_path):
    def make(*extra, run_dir=None):
        return load_config(
            None, tiny_args(tiny_corpus, run_dir or tmp_path / "run", tmp_path.parent / "data", *extra)
        )

    return make


os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def two_hosts():
    if shutil.which("ip") is None:
        pytest.skip("two-host test: the `ip` command (Debian iproute2) is not installed")
    hosts = EmulatedNodes(str(os.getpid()))  # no limits: plain veth
    try:
        hosts.create()
    except subprocess.CalledProcessError as err:
        hosts.remove()
        pytest.skip(
            f"two-host test: cannot create network namespaces here ({err.stderr.strip()}); it needs root "
            "(CAP_NET_ADMIN)"
        )
    yield hosts
    hosts.remove()
