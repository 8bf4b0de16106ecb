"""What a config edit does to experiment assignments, before it ships.

:func:`diff` pairs the experiments of two configs (by name, then by client
model: a new name on the same client model is a rename) and, for each pair,
gives the expected share of sticky callers that change arm, cell by cell
(:mod:`sidecar.experiments.reassignment`, exact), plain-words notes for edits that
re-draw callers, and, given the callers' sticky values, the actual movers,
recomputed with the request path's own race. ``model-router experiments
diff`` prints it (:mod:`sidecar.commands.diff`) and ``POST /admin/config?dry_run=1``
answers it for the running config.

Pure: the sticky values come in as :class:`KeyList` or :class:`SeenKeys`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Protocol

from ..config.schema import Config, Experiment
from ..routing.assignment import ALGORITHM, Race, is_blank, salt_prefix
from . import reassignment

__all__ = ["Diff", "ExperimentDiff", "KeyList", "Observed", "SeenKeys", "diff"]

Callers = list[tuple[str, str]]  # (label shown for the caller, its sticky value)


class CallerSource(Protocol):
    @property
    def source(self) -> str:
        """Where the callers come from, as the report names it."""
        ...

    def callers(self, exp: Experiment) -> Callers | str:
        """The callers to recompute for ``exp`` (in the old config), or why there are none."""
        ...


@dataclass(frozen=True)
class KeyList:
    """Sticky values given one per line: the same callers for every experiment."""

    values: tuple[str, ...]
    source: str = "keys"

    def callers(self, exp: Experiment) -> Callers | str:
        if exp.sticky_key == "none":
            return "sticky_key is none: no request carries a sticky value"
        return [(v, v) for v in dict.fromkeys(self.values) if not is_blank(v)]


@dataclass(frozen=True)
class SeenKeys:
    """The key ids usage records show in each experiment, and the keys they stand for.

    Movers are named by key id; the keys themselves are never shown.
    """

    by_experiment: Mapping[str, Sequence[str]]  # experiment name -> distinct key ids
    keys: Mapping[str, str]  # key id -> key, from the old config's api_keys
    source: str = "usage records"

    def callers(self, exp: Experiment) -> Callers | str:
        if exp.sticky_key != "api_key":
            return f"usage records carry key ids, and this experiment hashes sticky_key {exp.sticky_key}: pass --keys"
        if not self.keys:
            return "the old config has no api_keys, so usage records name no key"
        ids = self.by_experiment.get(exp.name, ())
        return [(i, self.keys[i]) for i in ids if i in self.keys]


@dataclass(frozen=True)
class Arm:
    variant_id: str
    old_model: str | None  # None: not declared on that side
    new_model: str | None
    old_weight: int
    new_weight: int
    old_share: Fraction
    new_share: Fraction


@dataclass(frozen=True)
class Observed:
    source: str
    keys: int
    movers: tuple[tuple[str, str, str], ...]  # (caller, from arm, to arm), in input order

    def to_dict(self) -> dict[str, Any]:
        moves = Counter((f, t) for _, f, t in self.movers)
        return {
            "source": self.source,
            "keys": self.keys,
            "movers": len(self.movers),
            "share": len(self.movers) / self.keys if self.keys else None,
            "moves": [{"from": f, "to": t, "count": n} for (f, t), n in moves.most_common()],
            "movers_list": [{"caller": c, "from": f, "to": t} for c, f, t in self.movers],
        }


@dataclass(frozen=True)
class ExperimentDiff:
    name: str
    status: str  # unchanged | changed | renamed | added | removed
    old: Experiment | None
    new: Experiment | None
    notes: tuple[str, ...] = ()
    arms: tuple[Arm, ...] = ()
    kept_key_share: Fraction | None = None  # callers whose caller key survives the edit
    expected: reassignment.Joint | None = None  # (from, to) -> share; None: no sticky callers (added, removed, none)
    observed: Observed | None = None
    observed_note: str | None = None  # why there is no observation

    @property
    def reshuffle(self) -> bool:
        """Every caller is drawn afresh: no caller key survives the edit."""
        return self.kept_key_share == 0

    @property
    def moving_share(self) -> Fraction | None:
        if self.expected is None:
            return None
        return 1 - sum((s for (f, t), s in self.expected.items() if f == t), Fraction(0))

    @property
    def minimum_share(self) -> Fraction | None:
        """The fewest callers any assignment could move to reach the new shares."""
        if self.expected is None:
            return None
        return sum((max(Fraction(0), a.old_share - a.new_share) for a in self.arms), Fraction(0))

    def to_dict(self) -> dict[str, Any]:
        def side(e: Experiment | None) -> dict[str, Any] | None:
            if e is None:
                return None
            return {"name": e.name, "model": e.model, "sticky_key": e.sticky_key, "sticky_ttl": e.sticky_ttl}

        expected = None
        if self.expected is not None:
            moves = sorted(((s, f, t) for (f, t), s in self.expected.items() if f != t), key=lambda m: (-m[0], m[1], m[2]))
            expected = {
                "moving_share": float(self.moving_share or 0),
                "minimum_share": float(self.minimum_share or 0),
                "kept_key_share": float(self.kept_key_share) if self.kept_key_share is not None else None,
                "moves": [{"from": f, "to": t, "share": float(s)} for s, f, t in moves],
            }
        return {
            "experiment": self.name,
            "status": self.status,
            "reshuffle": self.reshuffle,
            "old": side(self.old),
            "new": side(self.new),
            "notes": list(self.notes),
            "arms": [
                {
                    "variant_id": a.variant_id, "old_model": a.old_model, "new_model": a.new_model,
                    "old_weight": a.old_weight, "new_weight": a.new_weight,
                    "old_share": float(a.old_share), "new_share": float(a.new_share),
                }
                for a in self.arms
            ],
            "expected": expected,
            "observed": self.observed.to_dict() if self.observed is not None else None,
            "observed_note": self.observed_note,
        }


@dataclass(frozen=True)
class Diff:
    unix_time: float
    experiments: tuple[ExperimentDiff, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "algorithm": ALGORITHM,
            "unix_time": self.unix_time,
            "experiments": [e.to_dict() for e in self.experiments],
        }


def diff(old: Config, new: Config, unix_time: float, callers: CallerSource | None = None) -> Diff:
    """Every experiment of either config, paired, with what the edit does to its callers at ``unix_time``."""
    out: list[ExperimentDiff] = []
    for o, n in _pairs(old.model_experiments, new.model_experiments):
        if o is None and n is not None:
            out.append(ExperimentDiff(n.name, "added", None, n, notes=(
                f"new experiment on client model '{n.model}': its callers start drawing arms now",
            )))
        elif n is None and o is not None:
            out.append(ExperimentDiff(o.name, "removed", o, None, notes=(
                f"experiment removed: requests for '{o.model}' no longer draw an arm",
            )))
        elif o is not None and n is not None:
            out.append(_compare(o, n, unix_time, callers))
    return Diff(float(unix_time), tuple(out))


def _pairs(old: Sequence[Experiment], new: Sequence[Experiment]) -> list[tuple[Experiment | None, Experiment | None]]:
    """Same name first; then an unmatched old and new experiment on the same client model are a rename."""
    new_by_name = {e.name: e for e in new}
    old_names = {e.name for e in old}
    left = [e for e in new if e.name not in old_names]
    pairs: list[tuple[Experiment | None, Experiment | None]] = []
    for o in old:
        n = new_by_name.get(o.name) or next((e for e in left if e.model == o.model), None)
        if n is not None and n.name != o.name:
            left.remove(n)
        pairs.append((o, n))
    pairs += [(None, n) for n in left]
    return pairs


def _compare(old: Experiment, new: Experiment, unix_time: float, source: CallerSource | None) -> ExperimentDiff:
    status = "unchanged" if old == new else "renamed" if old.name != new.name else "changed"
    if old.sticky_key == new.sticky_key == "none":
        return ExperimentDiff(new.name, status, old, new, notes=tuple(_notes(old, new, Fraction(0))),
                              arms=_arms(old, new), observed_note="sticky_key is none: no caller keeps an arm")
    old_v = list(old.race)
    new_v = list(new.race)
    kept = _kept(old, new, unix_time)
    joint = _mix(kept, reassignment.same_key(old_v, new_v), reassignment.independent(old_v, new_v))
    observed: Observed | None = None
    note: str | None = None
    if source is None:
        note = "no sticky values given"
    elif old.sticky_key != new.sticky_key:
        note = "sticky_key changes, so a caller's new sticky value is not in the list"
    else:
        listed = source.callers(old)
        if isinstance(listed, str):
            note = listed
        else:
            observed = _observe(old, new, listed, unix_time, source.source)
    return ExperimentDiff(
        name=new.name, status=status, old=old, new=new, notes=tuple(_notes(old, new, kept)),
        arms=_arms(old, new), kept_key_share=kept, expected=joint, observed=observed, observed_note=note,
    )


def _kept(old: Experiment, new: Experiment, unix_time: float) -> Fraction:
    """The share of callers whose caller key (name, sticky value, TTL window) survives."""
    if old.name != new.name or old.sticky_key != new.sticky_key or "none" in (old.sticky_key, new.sticky_key):
        return Fraction(0)
    return reassignment.kept_key_share(old.sticky_ttl, new.sticky_ttl, unix_time)


def _mix(kept: Fraction, same: reassignment.Joint, fresh: reassignment.Joint) -> reassignment.Joint:
    cells = dict.fromkeys([*same, *fresh])
    mixed = {c: kept * same.get(c, Fraction(0)) + (1 - kept) * fresh.get(c, Fraction(0)) for c in cells}
    return {c: s for c, s in mixed.items() if s}


def _arms(old: Experiment, new: Experiment) -> tuple[Arm, ...]:
    p = reassignment.shares(list(old.race))
    q = reassignment.shares(list(new.race))
    olds = {v.id: v for v in old.variants}
    news = {v.id: v for v in new.variants}
    zero = Fraction(0)
    return tuple(
        Arm(
            vid,
            olds[vid].model if vid in olds else None, news[vid].model if vid in news else None,
            olds[vid].race_weight if vid in olds else 0, news[vid].race_weight if vid in news else 0,
            p.get(vid, zero), q.get(vid, zero),
        )
        for vid in dict.fromkeys([*olds, *news])
    )


def _observe(old: Experiment, new: Experiment, callers: Callers, unix_time: float, source: str) -> Observed:
    """Each caller's arm under both configs, by the request path's race."""
    old_race, new_race = Race(old.race), Race(new.race)
    old_prefix, new_prefix = salt_prefix(old.name), salt_prefix(new.name)
    movers = []
    for label, value in callers:
        was = old.variants[old_race.pick(old_prefix, value, old.sticky_ttl, unix_time)].id
        now = new.variants[new_race.pick(new_prefix, value, new.sticky_ttl, unix_time)].id
        if was != now:
            movers.append((label, was, now))
    return Observed(source, len(callers), tuple(movers))


def _ttl(seconds: int | None) -> str:
    if seconds is None:
        return "none"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _notes(old: Experiment, new: Experiment, kept: Fraction) -> list[str]:
    """Plain words for the edits that re-draw callers or change what an arm serves."""
    afresh = "every caller is drawn afresh, as if new to the experiment"
    notes = []
    if old.name != new.name:
        notes.append(f"renamed from '{old.name}' to '{new.name}': the name salts the hash, so {afresh}")
    if old.model != new.model:
        notes.append(f"client model changes from '{old.model}' to '{new.model}': requests for '{old.model}' "
                     "no longer enter this experiment")
    if old.sticky_key != new.sticky_key:
        notes.append(f"sticky_key changes from {old.sticky_key} to {new.sticky_key}: callers are hashed by "
                     f"another value, so {afresh}")
    elif new.sticky_key == "none":
        notes.append("sticky_key is none: every request draws at random, so there are no sticky callers to move")
    if old.sticky_ttl != new.sticky_ttl and old.name == new.name and old.sticky_key == new.sticky_key:
        change = f"sticky_ttl changes from {_ttl(old.sticky_ttl)} to {_ttl(new.sticky_ttl)}"
        if kept == 0:
            notes.append(f"{change}: the TTL window is part of the caller key, so {afresh}")
        else:
            notes.append(f"{change}: {float(kept):.2%} of callers keep their window number at this instant and "
                         "their draw; the rest are drawn afresh")
    olds = {v.id: v for v in old.variants}
    news = {v.id: v for v in new.variants}
    gone = [vid for vid in olds if vid not in news]
    added = [vid for vid in news if vid not in olds]
    for vid in gone:
        same = [a for a in added if news[a].model == olds[vid].model]
        if same:
            notes.append(f"variant '{vid}' is gone and '{same[0]}' serves the same model '{olds[vid].model}': "
                         "a variant id is hashed, so this is a new arm, not a relabel; its callers are re-drawn")
        else:
            notes.append(f"variant '{vid}' is removed: its callers spread over the remaining arms by weight")
    for vid in added:
        if news[vid].race_weight == 0:
            notes.append(f"variant '{vid}' is added with weight 0: no caller moves to it yet")
        else:
            notes.append(f"variant '{vid}' is added: it draws its share from every arm")
    for vid, v in olds.items():
        n = news.get(vid)
        if n is None:
            continue
        if v.race_weight > 0 and n.race_weight == 0:
            notes.append(f"variant '{vid}' is paused (weight 0): its callers spread over the others by weight")
        elif v.race_weight == 0 and n.race_weight > 0:
            notes.append(f"variant '{vid}' is resumed: it takes callers back from every arm")
        if v.model != n.model:
            notes.append(f"variant '{vid}' now dispatches '{n.model}' instead of '{v.model}': its callers stay "
                         "on the arm and get the new model")
    return notes
