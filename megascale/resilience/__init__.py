"""Keeping a long job alive (paper §4): a driver, one executor per node, heartbeats through a store,
fault detection, diagnostics, eviction and automatic restart from the newest verified checkpoint.

The driver and the executors never import the trainer: they start processes (torchrun) and talk to them
through the store and small files. The trainer reports its progress through `client.py` and takes its
injected faults from `inject.py`.
"""
