"""The self-check's network part (paper §4.3): an all-reduce between neighbouring nodes, checked and timed.

A node's own checks (diagnostics.py) cannot see a bad link or a bad NIC; a collective with another node can.
The driver pairs each node with its neighbours in a ring and splits the pairs into rounds in which every
node is in at most one pair (`link_rounds`). Each executor runs its pairs in round order in a fresh
process, so two nodes only ever wait for each other and no global barrier is needed: the leader of a pair
serves a TCPStore on its own address, tells its peer the port through the control store, and the pair
forms a two-rank gloo group and all-reduces a buffer of known values.

A link is bad when its data is wrong or its rate is below `min_speed_ratio` of the expected one
(`resilience.expected_allreduce_gbps`, else the median of the links measured together, three or more). A
node is to blame when all its links are bad while each of its peers has a good link elsewhere
(`blame`); a pair of nodes alone cannot tell which end is at fault, so neither is blamed then.
torch.distributed has every collective but nothing that tests a cluster's links pairwise; hence this.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any

from megascale.resilience.inject import active_faults


def link_rounds(nodes: list[str]) -> list[list[tuple[str, str]]]:
    """The ring's pairs (leader first), grouped into rounds in which no node appears twice."""
    count = len(nodes)
    if count < 2:
        return []
    edges = (
        [(nodes[0], nodes[1])] if count == 2 else [(nodes[i], nodes[(i + 1) % count]) for i in range(count)]
    )
    rounds: list[list[tuple[str, str]]] = []
    for edge in edges:
        for pairs in rounds:
            if not {node for pair in pairs for node in pair} & set(edge):
                pairs.append(edge)
                break
        else:
            rounds.append([edge])
    return rounds


def plan_for(node: str, rounds: list[list[tuple[str, str]]]) -> list[dict[str, Any]]:
    """This node's part of the rounds: for each round it takes part in, its peer and whether it leads."""
    plan = []
    for index, pairs in enumerate(rounds):
        for leader, follower in pairs:
            if node in (leader, follower):
                peer = follower if node == leader else leader
                plan.append(
                    {"round": index, "peer": peer, "leader": node == leader, "key": f"{leader}~{follower}"}
                )
    return plan


def _pair_allreduce(link: dict[str, Any], spec: dict[str, Any], control: Any) -> dict[str, Any]:
    """One pair's check, from one end: {'ok': bool, 'gbps': float} or {'ok': False, 'error': str}."""
    import torch
    import torch.distributed as dist

    key = f"link/{spec['check']}/{link['key']}"
    timeout = timedelta(seconds=spec["timeout_s"])
    if link["leader"]:
        store = dist.TCPStore(
            spec["address"] or "", 0, 2, is_master=True, timeout=timeout, wait_for_workers=False
        )
        control.put(key, store.port)
    else:
        deadline = time.monotonic() + spec["timeout_s"]
        while (port := control.fetch(key)) is None:
            if time.monotonic() > deadline:
                return {"ok": False, "error": "the peer never served its end"}
            time.sleep(0.05)
        store = dist.TCPStore(spec["addresses"][link["peer"]], port, 2, is_master=False, timeout=timeout)
    rank = 0 if link["leader"] else 1
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    try:
        value = 1.0 if link["leader"] else 2.0
        if spec.get("corrupt"):
            value += 0.5  # fault injection: this node's data is damaged on the way
        buffer = torch.full((spec["megabytes"] * (1 << 20) // 4,), value)
        dist.all_reduce(buffer)  # warm-up: connections made
        buffer.fill_(value)
        started = time.perf_counter()
        for _ in range(spec["repeats"]):
            dist.all_reduce(buffer)
            buffer.fill_(value)
        seconds = time.perf_counter() - started
        dist.all_reduce(buffer)
        correct = bool((buffer == 3.0).all())
        # Bus bandwidth of a two-rank all-reduce: each rank sends and receives its buffer once.
        return {"ok": correct, "gbps": round(buffer.numel() * 4 * spec["repeats"] / seconds / 1e9, 3)}
    finally:
        dist.destroy_process_group()


def _links_worker(spec: dict[str, Any], result_path: str) -> None:
    """A fresh process: run this node's pairs in round order, write {peer: result} as JSON."""
    import torch

    from megascale.host import interface_of
    from megascale.stores.control import open_store

    torch.set_num_threads(1)
    interface = interface_of(spec["address"]) if spec["address"] else None
    if interface and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    control = open_store(spec["store"], job=spec["job"])
    results = {}
    for link in spec["plan"]:
        try:
            results[link["peer"]] = _pair_allreduce(link, spec, control)
        except Exception as err:  # noqa: BLE001 (a broken link is a result, not a crash)
            results[link["peer"]] = {"ok": False, "error": f"{type(err).__name__}: {err}"[:300]}
    with open(result_path, "w") as file:
        json.dump(results, file)


def run_link_checks(
    node: str, command: dict[str, Any], store_url: str, job: str, address: str | None
) -> dict:
    """This node's pairs of the driver's `command`; {peer: {'ok', 'gbps' or 'error'}}."""
    node_index = int(node.rsplit("-", 1)[-1]) if node.rsplit("-", 1)[-1].isdigit() else -1
    corrupt = any(
        fault.kind == "link_fail" and int(fault.get("node", -2)) == node_index
        for fault in active_faults(command.get("inject"), int(command.get("attempt", 0)))
    )
    spec = {
        "plan": plan_for(node, command["rounds"]),
        "check": command["check"],
        "store": store_url,
        "job": job,
        "address": address,
        "addresses": command["addresses"],
        "megabytes": command.get("megabytes", 8),
        "repeats": command.get("repeats", 4),
        "timeout_s": command.get("timeout_s", 60.0),
        "corrupt": corrupt,
    }
    if not spec["plan"]:
        return {}
    with tempfile.TemporaryDirectory() as directory:
        result_path = os.path.join(directory, "links.json")
        process = multiprocessing.get_context("spawn").Process(target=_links_worker, args=(spec, result_path))
        process.start()
        process.join(timeout=spec["timeout_s"] * (len(spec["plan"]) + 1))
        if process.is_alive():
            process.kill()
            process.join()
        if not os.path.exists(result_path):
            return {link["peer"]: {"ok": False, "error": "the check did not finish"} for link in spec["plan"]}
        with open(result_path) as file:
            return json.load(file)


def blame(
    results: dict[str, dict[str, dict[str, Any]]], expected_gbps: float | None, min_speed_ratio: float
) -> tuple[dict[str, str], list[tuple[str, str, str]]]:
    """From every node's {peer: result}: (the nodes to blame with the reason, every bad link with why).

    A link is judged from both ends' reports (bad if either end saw wrong data or an error, its rate the
    slower end's)."""
    links: dict[frozenset, dict[str, Any]] = {}
    for node, peers in results.items():
        for peer, result in peers.items():
            link = links.setdefault(frozenset((node, peer)), {"ok": True, "gbps": float("inf")})
            link["ok"] = link["ok"] and result.get("ok", False)
            link["gbps"] = min(link["gbps"], result.get("gbps", 0.0))
            if "error" in result:
                link["error"] = result["error"]
    rates = [link["gbps"] for link in links.values() if link["ok"]]
    reference = expected_gbps or (statistics.median(rates) if len(rates) >= 3 else None)
    bad = {}
    for pair, link in links.items():
        if not link["ok"]:
            bad[pair] = link.get("error", "wrong all-reduce result")
        elif reference and link["gbps"] < min_speed_ratio * reference:
            bad[pair] = f"{link['gbps']} GB/s, below {min_speed_ratio:.2f} x {reference:.3g}"
    blamed = {}
    for node in results:
        mine = [pair for pair in links if node in pair]
        if not mine or not all(pair in bad for pair in mine):
            continue
        neighbours = [next(iter(pair - {node})) for pair in mine]
        peers_fine = all(any(other not in bad for other in links if peer in other) for peer in neighbours)
        if peers_fine:
            blamed[node] = "all-reduce with every neighbour failed: " + "; ".join(
                f"{next(iter(pair - {node}))}: {bad[pair]}" for pair in mine
            )
    bad_links = [(*sorted(pair), why) for pair, why in bad.items()]
    return blamed, sorted(bad_links)
