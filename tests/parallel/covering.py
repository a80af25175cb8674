"""A covering set of the configuration space's combinations: every pair (or, with `strength=3`, every
triple) of knob values that can be active together in some combination megascale accepts.

`covering_rows` returns the accepted combinations, and for a tuple no accepted combination can hold a
refused one with megascale's reason, which the parity matrix asserts. No library on our registries
generates covering arrays under constraints that only a whole combination can check (megascale's own
validation decides), so the greedy construction (AETG's: grow each combination around a missing tuple,
keep the candidate that covers most) is written here.
"""

from __future__ import annotations

import collections
import functools
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass

from tests.parallel.config_space import (
    KNOBS,
    Row,
    can_be_active,
    canonical,
    default_row,
    fill,
    holds,
    knob,
    tuples_of,
    world_size,
)


@dataclass
class Covering:
    """Accepted combinations; for each tuple no accepted one can hold, a refused one and megascale's
    reason; and the tuples the search could neither cover nor show refused (none, in a sound search)."""

    accepted: list[Row]
    refused: list[tuple[tuple, Row, str]]
    missed: list[tuple]
    strength: int


def _search(
    target: tuple,
    rng: random.Random,
    variant: Callable[[Row], Row],
    score: Callable[[Row], float | None],
    attempts: int,
    candidates: int,
) -> Row | None:
    """The best-scoring row of random fillings of `target` (each also with `variant`'s values), tried until
    `candidates` were tried with one accepted (`score` not None), or `attempts` in all."""
    best, best_score, tries = None, -1.0, 0
    while tries < attempts and (best is None or tries < candidates):
        tries += 1
        filled = fill(target, rng)
        for row in (filled, canonical({**filled, **variant(filled), **dict(target)})):
            value = score(row)
            if value is not None and value > best_score:
                best, best_score = row, value
    return best


VERDICTS_KEPT = 200_000  # megascale's verdicts a covering search remembers (about 150 MB)


class Verdicts:
    """`refusal` of a row, the most recent `kept` verdicts remembered by the row's values: a search for
    triples scores millions of random rows, few of them twice, and remembering every verdict (by the
    rows' items) took more than 12 GB."""

    def __init__(self, refusal: Callable[[Row], str | None], kept: int = VERDICTS_KEPT) -> None:
        keys = tuple(k.key for k in KNOBS)
        self._keys = keys
        self._verdict = functools.lru_cache(maxsize=kept)(lambda values: refusal(dict(zip(keys, values))))

    def __call__(self, row: Row) -> str | None:
        return self._verdict(tuple(row[key] for key in self._keys))

    def remembered(self) -> int:
        return self._verdict.cache_info().currsize


def covering_rows(
    refusal: Callable[[Row], str | None],
    *,
    strength: int = 2,
    max_world: int = 8,
    seed: int = 0,
    candidates: int = 40,
    attempts: int = 120,
    required: tuple[Row, ...] = (),
    cost: Callable[[Row], float] = world_size,
    bonus: Callable[[Row, list[Row]], float] = lambda row, accepted: 0.0,
    variant: Callable[[Row], Row] = lambda row: {},
) -> Covering:
    """Combinations covering every `strength`-tuple of knob values that can be active together.

    `refusal(row)` is megascale's own verdict: None when it accepts the combination, else its one-line
    reason. Rows start with the `required` ones (e.g. one of one process); then, while a tuple is
    uncovered, the one whose cheapest row costs most is fixed, with its prerequisites, and the other
    knobs filled at random
    until `candidates` accepted rows of at most `max_world` processes are found (or `attempts` tried),
    keeping the one that covers most new tuples (plus its `bonus`, given the rows taken so far) for its
    `cost` (by default its processes); each filling is also tried with the values `variant` suggests for
    it (the target's kept), which lets a caller steer rows towards a property its bonus rewards. A tuple no
    accepted row was found for is refused when megascale refuses it with every other knob at its default,
    and otherwise reported missed."""
    rng = random.Random(seed)
    refused_why = Verdicts(refusal)

    uncovered = activatable(strength)
    # The tuples that need the costliest rows (the largest layouts, a compilation) are targeted first: their
    # rows then take many cheap tuples along, instead of being added late for one tuple each.
    least_cost = {target: cost(fill(target, random.Random(0), default_row())) for target in uncovered}
    cheapest = min(least_cost.values(), default=1.0)
    accepted: list[Row] = []
    refused: list[tuple[tuple, Row, str]] = []
    missed: list[tuple] = []

    def take(row: Row) -> None:
        accepted.append(row)
        uncovered.difference_update(tuples_of(row, strength))

    for row in required:
        row = canonical({**default_row(), **row})
        if refused_why(row) is None and world_size(row) <= max_world:
            take(row)
    pinned = list(accepted)
    # Targets in that order, once: each turn takes the first still uncovered (the order never changes).
    queue = iter(sorted(uncovered, key=lambda item: (-least_cost[item], _order(item))))
    while uncovered:
        target = next(item for item in queue if item in uncovered)
        # A costly row is searched harder (up to 10 times), so that few rows pay that much.
        effort = min(10, round(least_cost[target] / cheapest))
        effort = 10 if any(knob(key).costly for key, _ in target) else effort

        def score(row: Row, target: tuple = target) -> float | None:
            if not holds(row, target) or world_size(row) > max_world or refused_why(row) is not None:
                return None
            return (len(tuples_of(row, strength) & uncovered) + bonus(row, accepted)) / cost(row)

        best = _search(target, rng, variant, score, attempts * effort, candidates * effort)
        if best is not None:
            take(best)
            continue
        uncovered.discard(target)
        row = fill(target, random.Random(0), default_row())
        reason = refused_why(row)
        if reason is None:
            missed.append(target)
        else:
            refused.append((target, row, reason))
    rows = _without_redundant(accepted, strength, cost, pinned)
    rows = _cheapened(rows, strength, cost, pinned, lambda row: refused_why(row) is None, max_world)
    return Covering(rows, refused, missed, strength)


def _cheapened(
    rows: list[Row],
    strength: int,
    cost: Callable[[Row], float],
    pinned: list[Row],
    accepted: Callable[[Row], bool],
    max_world: int,
) -> list[Row]:
    """Each row (the costliest first) replaced, while one exists, by a cheaper accepted one that differs in
    one knob and still holds every tuple no other row holds: a local search after the greedy cover, which
    drops what a row paid for early and no longer needs (a compilation, a larger layout)."""
    rows = list(rows)
    holders = _holders(rows, strength)  # how many rows hold each tuple
    improved = True
    while improved:
        improved = False
        for index in sorted(range(len(rows)), key=lambda i: cost(rows[i]), reverse=True):
            row = rows[index]
            if any(row is pin for pin in pinned):
                continue
            held = tuples_of(row, strength)
            unique = {item for item in held if holders[item] == 1}
            for knob_ in KNOBS:
                for value in knob_.values:
                    changed = canonical({**row, knob_.key: value})
                    if (
                        cost(changed) < cost(row)
                        and world_size(changed) <= max_world
                        and tuples_of(changed, strength) >= unique
                        and accepted(changed)
                    ):
                        row, improved = changed, True
            if row is not rows[index]:
                holders.subtract(held)
                holders.update(tuples_of(row, strength))
            rows[index] = row
    return rows


def _without_redundant(
    rows: list[Row], strength: int, cost: Callable[[Row], float], pinned: list[Row]
) -> list[Row]:
    """`rows` less those whose every tuple others hold too, the costliest dropped first (a greedy set
    cover picks early rows before the later ones make them redundant); `pinned` rows stay."""
    kept = list(rows)
    holders = _holders(rows, strength)
    for row in sorted(rows, key=cost, reverse=True):
        if any(row is pin for pin in pinned):
            continue
        held = tuples_of(row, strength)
        if all(holders[item] > 1 for item in held):
            kept = [other for other in kept if other is not row]
            holders.subtract(held)
    return kept


def _holders(rows: list[Row], strength: int) -> collections.Counter:
    """How many of `rows` hold each tuple: a tuple one row alone holds is that row's to keep."""
    return collections.Counter(item for row in rows for item in tuples_of(row, strength))


def wanted(strength: int) -> set[tuple]:
    """Every `strength`-tuple of values of distinct knobs, active together or not."""
    wanted = set()
    for knobs in itertools.combinations(KNOBS, strength):
        for values in itertools.product(*(k.values for k in knobs)):
            wanted.add(tuple(zip((k.key for k in knobs), values)))
    return wanted


def activatable(strength: int) -> set[tuple]:
    """The `strength`-tuples a covering set must hold: those whose values can be active together."""
    return {target for target in wanted(strength) if can_be_active(target)}


def _order(item: tuple) -> tuple:
    return tuple((key, repr(value)) for key, value in item)
