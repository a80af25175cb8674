"""The hang analysis on made-up rank states: who the others wait for."""

from megascale.observe.hang import analyze, describe


def state(rank, groups, waiting=None, world=4, phase=None):
    return {
        "rank": rank,
        "world_size": world,
        "coords": {"pp": 0, "dp": rank, "tp": 0},
        "step": 5,
        "phase": phase,
        "groups": [
            {"name": name, "ranks": ranks, "issued": issued, "completed": issued - 1}
            for name, ranks, issued in groups
        ],
        "waiting": waiting,
    }


DP = ("dp", [0, 1, 2, 3])


def test_the_rank_outside_any_collective_and_behind_is_the_suspect():
    dumps = {
        rank: state(rank, [(*DP, 10)], {"kind": "all_reduce", "group": "dp", "seq": 10}) for rank in (0, 2, 3)
    }
    dumps[1] = state(1, [(*DP, 9)], None, phase="forward")
    result = analyze(dumps)
    assert result["suspects"] == [1] and "phase forward" in result["reasons"][1]
    assert "suspects:\n  rank 1" in describe(dumps, result)


def test_a_rank_that_wrote_nothing_is_a_suspect():
    dumps = {
        rank: state(rank, [(*DP, 10)], {"kind": "all_reduce", "group": "dp", "seq": 10}) for rank in (0, 1, 3)
    }
    assert analyze(dumps)["suspects"] == [2]


def test_groups_of_one_name_are_told_apart_by_their_members():
    # Two pipeline stages, each with its own data-parallel group called "dp": stage 1 is one step behind
    # stage 0 and that is normal; within stage 1, rank 3 is behind rank 2.
    dumps = {
        0: state(0, [("dp", [0, 1], 20)], {"kind": "irecv", "group": "pp", "seq": 3}),
        1: state(1, [("dp", [0, 1], 20)], {"kind": "irecv", "group": "pp", "seq": 3}),
        2: state(2, [("dp", [2, 3], 15)], {"kind": "all_gather_single", "group": "dp", "seq": 15}),
        3: state(3, [("dp", [2, 3], 14)], None),
    }
    assert analyze(dumps)["suspects"] == [3]


def test_when_every_rank_is_blocked_those_behind_are_named():
    waiting = {"kind": "all_reduce", "group": "dp", "seq": 10}
    dumps = {rank: state(rank, [(*DP, 10)], waiting) for rank in (0, 1, 2)}
    dumps[3] = state(3, [(*DP, 9)], {"kind": "broadcast", "group": "world", "seq": 4})  # a mismatch
    result = analyze(dumps)
    assert result["suspects"] == [3] and "blocked in broadcast" in result["reasons"][3]


def test_no_one_is_named_when_all_are_level():
    waiting = {"kind": "all_reduce", "group": "dp", "seq": 10}
    dumps = {rank: state(rank, [(*DP, 10)], waiting) for rank in range(4)}
    result = analyze(dumps)
    assert result["suspects"] == [] and "no suspect" in describe(dumps, result)
