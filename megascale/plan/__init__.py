"""Planning before the cluster exists: a cost model of one training step, the layout search, placement and
hardware profiles (docs/planning.md; paper §2, §3, §6).
"""
