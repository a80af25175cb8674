"""The self-check: matmul, memory and an all-to-all among real local processes; rates against an
expected figure or against the other nodes."""

from megascale.resilience.diagnostics import run_self_check, slower_than_peers


def test_a_healthy_node_passes_with_its_rates_measured():
    result = run_self_check("node-0", {"nproc_per_node": 2})
    checks = result["checks"]
    print(f"matmul {checks['matmul_gflops']} GFLOP/s, all-to-all {checks['alltoall_gbps']} GB/s")
    assert result["passed"] and result["reason"] is None
    assert checks["matmul_correct"] and checks["memory_ok"] and checks["alltoall_correct"]
    assert checks["matmul_gflops"] > 0 and checks["alltoall_gbps"] > 0


def test_a_node_below_its_expected_speed_fails():
    result = run_self_check("node-0", {"expected_gflops": 1e9, "min_speed_ratio": 0.5})
    assert not result["passed"] and "matmul_gflops" in result["reason"] and "expected" in result["reason"]
    assert "alltoall_gbps" not in result["checks"]  # one process per node: nothing to exchange


def test_a_node_markedly_slower_than_its_peers_is_named():
    def result(gflops, gbps):
        return {"checks": {"matmul_gflops": gflops, "alltoall_gbps": gbps}}

    results = {"node-0": result(100, 1.0), "node-1": result(95, 0.9), "node-2": result(30, 1.1)}
    slow = slower_than_peers(results, 0.5)
    assert list(slow) == ["node-2"] and "matmul_gflops = 30" in slow["node-2"]
    results["node-2"] = result(98, 0.2)
    assert list(slower_than_peers(results, 0.5)) == ["node-2"]
    two = {"node-0": result(100, 1.0), "node-1": result(10, 1.0)}
    assert slower_than_peers(two, 0.5) == {}  # which of two is the slow one is not knowable


def test_an_injected_failure_fails_only_the_named_node():
    command = {"inject": "diagnose_fail:node=1", "bandwidth": False}
    assert run_self_check("node-0", command)["passed"]
    result = run_self_check("node-1", command)
    assert not result["passed"] and "injected" in result["reason"]
