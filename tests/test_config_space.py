"""The configuration space is one contract: every field is a knob of the parity matrix or says why it cannot
change the step, and the matrix's covering set holds every pair of knob values or shows it refused."""

import itertools
import random

from megascale.config import all_keys, load_config
from tests.parallel import config_space
from tests.parallel.covering import Verdicts
from tests.parallel.parity_matrix import STORED_PAIRS, covering, refusal, stored_pairs
from tests.parallel.refusal_rules import refusing


def get_key(cfg, key):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_every_config_field_is_a_knob_or_says_why_it_cannot_change_the_step():
    knobs = [knob.key for knob in config_space.KNOBS]
    assert len(knobs) == len(set(knobs))
    assert not set(knobs) & set(config_space.NEUTRAL)
    unclassified = set(all_keys()) - set(knobs) - set(config_space.NEUTRAL)
    assert not unclassified, f"add these fields to config_space.KNOBS or NEUTRAL: {sorted(unclassified)}"
    assert not (set(knobs) | set(config_space.NEUTRAL)) - set(all_keys())  # no stale entries


def test_a_knobs_values_are_values_its_field_accepts():
    """Each value alone, with what the knob needs set to do anything (float8 all-gathers need float8)."""
    for knob in config_space.KNOBS:
        for value in knob.values:
            setting = {**config_space.prerequisite_values(knob.key), knob.key: value}
            cfg = load_config(None, [f"--{key}={'' if v is None else v}" for key, v in setting.items()])
            assert get_key(cfg, knob.key) == value


def test_every_value_of_every_knob_can_be_made_active():
    """A knob whose value the matrix cannot switch on alone (a prerequisite missing from config_space's
    `_PREREQUISITES`) would have its pairs left out of the covering set as pairs that cannot be active."""
    inert = [
        (knob.key, value)
        for knob in config_space.KNOBS
        for value in knob.values
        if not config_space.can_be_active(((knob.key, value),))
    ]
    assert not inert


def test_the_covering_set_holds_every_pair_of_values_or_shows_it_refused():
    cover = covering(2)
    assert not cover.missed
    held = set()
    for row in cover.accepted:
        held |= config_space.tuples_of(row, 2)
    for target, row, reason in cover.refused:
        assert config_space.tuples_of(row, 2) >= {target}
        # One line, naming a knob of the pair it refuses, or one the pair needs set, and how to fix it.
        named = {key for key, _ in target}.union(*(config_space.prerequisites(key) for key, _ in target))
        assert "\n" not in reason and any(key in reason for key in named), (target, reason)
        held.add(target)
    for first, second in itertools.combinations(config_space.KNOBS, 2):
        for a, b in itertools.product(first.values, second.values):
            pair = ((first.key, a), (second.key, b))
            if config_space.can_be_active(pair):
                assert pair in held, pair


def test_megascale_refuses_exactly_what_its_documented_rules_refuse():
    """Each refusal of the covering set breaks a rule the documents state (tests/parallel/refusal_rules.py,
    written from them apart from the validator) and names a knob of it; no accepted combination breaks one;
    and the two agree on random combinations beyond the set."""
    cover = covering(2)
    for _, row, reason in cover.refused:
        broken = refusing(row)
        assert broken, f"refused by no documented rule: {reason}"
        assert any(key in reason for rule in broken for key in rule.knobs), (reason, [r.name for r in broken])
    for row in cover.accepted:
        assert not refusing(row), [rule.name for rule in refusing(row)]
    rng = random.Random(0)
    for _ in range(4000):
        row = config_space.fill((), rng)
        assert (refusal(row) is None) == (not refusing(row)), (refusal(row), [r.name for r in refusing(row)])


def test_the_suite_runs_the_stored_every_pair_set_and_it_covers_todays_knobs():
    """A knob or value added, or a refusal changed, makes the stored set stale: the suite would then generate
    a set at every start (slower, and not the one whose table docs/parity/pairs.md shows)."""
    stored = stored_pairs()
    assert stored is not None, (
        f"{STORED_PAIRS.name} no longer covers today's knobs: run python -m tests.parallel.parity_matrix "
        "--new-set (it stores a new set and writes docs/parity/pairs.md)"
    )
    assert covering(2).accepted == stored.accepted


def test_a_covering_search_remembers_its_most_recent_verdicts_only():
    """Scoring millions of random rows for triples, remembering every verdict took more than 12 GB: the
    search keeps the most recent `kept`, by the rows' values, and asks again for an older one."""
    asked = []

    def refusal(row):
        asked.append(row["training.micro_batch_size"])
        return None if row["training.micro_batch_size"] % 2 else "even"

    verdicts = Verdicts(refusal, kept=3)
    rows = [{**config_space.default_row(), "training.micro_batch_size": size} for size in range(1, 11)]
    assert [verdicts(row) for row in rows] == [None, "even"] * 5
    assert verdicts.remembered() == 3
    verdicts(rows[-1])  # remembered: not asked again
    verdicts(rows[0])  # forgotten: asked again
    assert asked == [*range(1, 11), 1]
