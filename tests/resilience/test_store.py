"""The control store through both back ends: TCPStore (hosted here) and a real Redis server."""

import gc
import threading

import pytest

from megascale.stores.control import OutageTolerantStore, open_store


@pytest.fixture(params=["tcp", "redis"])
def store_pair(request):
    if request.param == "tcp":
        host = open_store("tcp://127.0.0.1:0", job="j", host=True)
        return host, open_store(host.url, job="j")
    url = request.getfixturevalue("redis_url")
    return open_store(url, job="j"), open_store(url, job="j")


def test_values_travel_between_clients(store_pair):
    writer, reader = store_pair
    assert reader.fetch("hb/node-0") is None
    writer.put("hb/node-0", {"step": 3, "progress": {"0": {"loss": 1.5}}})
    assert reader.fetch("hb/node-0") == {"step": 3, "progress": {"0": {"loss": 1.5}}}
    writer.put("hb/node-0", {"step": 4})
    assert reader.fetch("hb/node-0") == {"step": 4}
    reader.delete("hb/node-0")
    assert writer.fetch("hb/node-0") is None


def test_a_put_is_visible_to_other_clients_as_soon_as_it_returns(store_pair):
    # TCPStore's set has no reply; without a round trip after it, ~10% of these reads missed the value.
    writer, reader = store_pair
    misses = [i for i in range(2000) if writer.put(f"k{i}", i) or reader.fetch(f"k{i}") is None]
    assert misses == []


def test_counters_count_every_client_once(store_pair):
    first, second = store_pair
    key = f"registered-{id(first)}"  # the Redis server is shared by the session's tests
    tickets = [client.add(key, 1) for client in (first, second, first, second)]
    assert tickets == [1, 2, 3, 4] and second.add(key, 0) == 4


def test_jobs_sharing_a_redis_server_do_not_see_each_other(redis_url):
    first, second = open_store(redis_url, job="a"), open_store(redis_url, job="b")
    first.put("cmd/node-0", {"action": "start"})
    assert second.fetch("cmd/node-0") is None


def test_a_bad_store_url_names_the_forms():
    with pytest.raises(ValueError, match="tcp://HOST:PORT or redis://HOST:PORT/DB"):
        open_store("http://x", job="j")


@pytest.mark.parametrize(
    "overrides, needles",
    [
        (["--resilience.store=tcp://10.0.0.1:29500"], ["resilience.job_id must be set", "SLURM_JOB_ID"]),
        (["--resilience.job_id=j1"], ["needs a fixed port", "tcp://HEAD_HOST:29500"]),
    ],
)
def test_external_executors_need_a_job_id_and_a_fixed_store_port(capsys, tmp_path, overrides, needles):
    from megascale.cli import main

    run_dir = f"--training.run_dir={tmp_path / 'run'}"
    status = main(["launch", "--resilience.executors=external", run_dir, *overrides])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and all(needle in err[0] for needle in needles), err
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_an_executor_refuses_another_jobs_driver_and_a_driver_refuses_a_used_job_id(redis_url, tmp_path):
    from megascale.config import load_config
    from megascale.errors import ConfigError
    from megascale.resilience.driver import Driver
    from megascale.resilience.executor import Executor

    tcp = open_store("tcp://127.0.0.1:0", job="ours", host=True)
    tcp.put("driver", {"job": "ours", "time": 0})
    with pytest.raises(ConfigError, match="runs job 'ours', not --job 'theirs'"):
        Executor(tcp.url, "theirs", "node-0", tmp_path, 1.0, connect_timeout_s=5)
    with pytest.raises(ConfigError, match="no driver of job 'late' came up"):
        Executor(redis_url, "late", "node-0", tmp_path, 1.0, connect_timeout_s=0.5)
    cfg = load_config(overrides=[f"--resilience.store={redis_url}", "--resilience.job_id=reused"])
    open_store(redis_url, job="reused").put("driver", {"job": "reused", "time": 0})  # an earlier run's
    with pytest.raises(ConfigError, match="was used by an earlier driver"):
        Driver(cfg, [], tmp_path).run()


def test_a_tcpstore_client_reaches_its_server_started_again_on_the_same_port():
    """A TCPStore client's socket stays broken once its server is gone; the outage-tolerant store makes
    a new client, so executors reach a driver started again on the dead one's port (a takeover)."""
    server = open_store("tcp://127.0.0.1:0", job="j", host=True)
    url = server.url
    client = OutageTolerantStore(
        open_store(url, job="j"), grace_s=20, reopen=lambda: open_store(url, job="j", timeout_s=2)
    )
    client.put("a", 1)
    del server  # the driver dies, and its store with it
    gc.collect()
    restarted = {}
    threading.Timer(1.0, lambda: restarted.update(server=open_store(url, job="j", host=True))).start()
    client.put("a", 2)  # rides out the outage on a new connection
    assert restarted["server"].fetch("a") == 2 and client.outages
