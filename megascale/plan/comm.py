"""Seconds of a collective or point-to-point transfer over the link its group uses (alpha-beta model).

A ring all-gather or reduce-scatter over n ranks moves (n - 1)/n of the tensor through each rank's link
in n - 1 latency-bound steps; an all-to-all sends each peer its part. A group inside a node uses NVLink,
any other the NICs, one a GPU (MegaScale, arXiv:2402.15627 §3.6): a node holding k of the group's ranks
runs k rings at once over k NICs, up to NVLink's rate.
"""

from __future__ import annotations

from megascale.plan.hardware import HardwareProfile


def group_spans_nodes(stride: int, size: int, devices_per_node: int) -> bool:
    """Whether a group of `size` ranks spaced `stride` apart (consecutive ranks share nodes) crosses nodes."""
    return size > 1 and stride * size > devices_per_node


def rails(stride: int, size: int, devices_per_node: int) -> int:
    """NICs a node drives at once for a ring over `size` ranks `stride` apart: one per rank it holds."""
    return max(1, min(size, devices_per_node // stride))


def link(profile: HardwareProfile, cross_node: bool, nics: int = 1) -> tuple[float, float]:
    """(bytes/s a collective achieves, latency) of a group's link; across nodes `nics` NICs at once."""
    intra = profile.intra_node_bytes_per_s * profile.network_efficiency
    if cross_node:
        inter = nics * profile.inter_node_bytes_per_s * profile.network_efficiency
        return min(inter, intra), profile.inter_node_latency_s
    return intra, profile.intra_node_latency_s


def group_gather_or_scatter_seconds(
    full_bytes: float, stride: int, ranks: int, profile: HardwareProfile
) -> float:
    """A ring all-gather (or reduce-scatter) of `full_bytes` over `ranks` ranks `stride` apart."""
    cross = group_spans_nodes(stride, ranks, profile.devices_per_node)
    nics = rails(stride, ranks, profile.devices_per_node)
    return gather_or_scatter_seconds(full_bytes, ranks, profile, cross, nics)


def gather_or_scatter_seconds(
    full_bytes: float, ranks: int, profile: HardwareProfile, cross_node: bool, nics: int = 1
) -> float:
    """A ring all-gather (or reduce-scatter) whose gathered tensor is `full_bytes`."""
    if ranks <= 1:
        return 0.0
    bandwidth, latency = link(profile, cross_node, nics)
    return (ranks - 1) * latency + (ranks - 1) / ranks * full_bytes / bandwidth


def send_seconds(payload_bytes: float, profile: HardwareProfile, cross_node: bool) -> float:
    """One point-to-point transfer (a send and its matching receive)."""
    bandwidth, latency = link(profile, cross_node)
    return latency + payload_bytes / bandwidth


def all_to_all_seconds(bytes_per_rank: float, ranks: int, stride: int, profile: HardwareProfile) -> float:
    """One all-to-all of `bytes_per_rank` from each of `ranks` ranks `stride` apart: the parts for peers on
    the node over NVLink, the rest over the NIC, at once."""
    if ranks <= 1:
        return 0.0
    on_node = max(1, min(ranks, profile.devices_per_node // stride))
    local_peers, remote_peers = on_node - 1, ranks - on_node
    part = bytes_per_rank / ranks
    seconds = 0.0
    for peers, cross in ((local_peers, False), (remote_peers, True)):
        if peers:
            bandwidth, latency = link(profile, cross)
            seconds = max(seconds, latency + peers * part / bandwidth)
    return seconds
