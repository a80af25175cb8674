"""The all-reduce between neighbouring nodes: pairing, blame, and real two-rank gloo groups per pair."""

import threading

import pytest

from megascale.resilience.links import blame, link_rounds, plan_for, run_link_checks
from megascale.stores.control import open_store


@pytest.mark.parametrize("count", [2, 3, 4, 5])
def test_rounds_cover_the_ring_and_no_node_is_twice_in_a_round(count):
    nodes = [f"node-{i}" for i in range(count)]
    rounds = link_rounds(nodes)
    edges = [frozenset(pair) for pairs in rounds for pair in pairs]
    ring = {frozenset((nodes[i], nodes[(i + 1) % count])) for i in range(count)}
    assert set(edges) == ring and len(edges) == len(ring)
    for pairs in rounds:
        members = [node for pair in pairs for node in pair]
        assert len(members) == len(set(members))
    assert len(rounds) == (1 if count == 2 else 2 if count % 2 == 0 else 3)
    assert sum(len(plan_for(node, rounds)) for node in nodes) == 2 * len(ring)


def good(gbps=1.0):
    return {"ok": True, "gbps": gbps}


def test_a_node_whose_every_link_fails_is_blamed_and_its_peers_are_not():
    bad = {"ok": False, "error": "wrong all-reduce result"}
    reports = {
        "node-0": {"node-1": bad, "node-2": good()},
        "node-1": {"node-0": bad, "node-2": bad},
        "node-2": {"node-1": bad, "node-0": good()},
    }
    blamed, bad_links = blame(reports, None, 0.5)
    assert list(blamed) == ["node-1"] and "node-0" in blamed["node-1"] and "node-2" in blamed["node-1"]
    assert [link[:2] for link in bad_links] == [("node-0", "node-1"), ("node-1", "node-2")]


def test_two_nodes_alone_cannot_say_which_end_is_bad():
    bad = {"ok": False, "error": "timeout"}
    blamed, bad_links = blame({"node-0": {"node-1": bad}, "node-1": {"node-0": good()}}, None, 0.5)
    assert blamed == {} and bad_links == [("node-0", "node-1", "timeout")]


def test_a_slow_link_is_judged_against_the_expected_rate_or_the_median():
    def ring(rates):
        names = [f"node-{i}" for i in range(len(rates))]
        reports = {name: {} for name in names}
        for i, rate in enumerate(rates):  # link i joins node i and node i+1
            a, b = names[i], names[(i + 1) % len(names)]
            reports[a][b] = reports[b][a] = good(rate)
        return reports

    # Node 2 sits between the two slow links (1-2 and 2-3); the others each keep a fast one.
    blamed, _ = blame(ring([1.0, 0.1, 0.1, 1.0]), None, 0.5)
    assert list(blamed) == ["node-2"]
    blamed, bad_links = blame(ring([1.0, 1.0, 1.0, 1.0]), 4.0, 0.5)  # every link below the expected rate
    assert blamed == {} and len(bad_links) == 4  # no node has a good link left to clear its peers


def test_real_pairs_find_the_node_whose_data_is_damaged():
    control = open_store("tcp://127.0.0.1:0", job="links", host=True)
    nodes = ["node-0", "node-1", "node-2"]
    command = {
        "seq": 1,
        "check": 7,
        "rounds": link_rounds(nodes),
        "addresses": {node: "127.0.0.1" for node in nodes},
        "inject": "link_fail:node=1",
        "megabytes": 1,
        "timeout_s": 60.0,
    }
    reports = {}

    def check(node):
        reports[node] = run_link_checks(node, command, control.url, "links", "127.0.0.1")

    threads = [threading.Thread(target=check, args=(node,)) for node in nodes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=240)
    assert set(reports) == set(nodes)
    print(
        {
            node: {peer: r.get("gbps", r.get("error")) for peer, r in peers.items()}
            for node, peers in reports.items()
        }
    )
    assert reports["node-0"]["node-2"]["ok"] and reports["node-0"]["node-2"]["gbps"] > 0
    assert not reports["node-0"]["node-1"]["ok"] and not reports["node-2"]["node-1"]["ok"]
    blamed, _ = blame(reports, None, 0.5)
    assert list(blamed) == ["node-1"]
