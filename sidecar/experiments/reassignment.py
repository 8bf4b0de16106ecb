"""Which sticky callers change arm when an experiment's variants change: exact shares.

For one caller key, ``mr-exp-v1`` gives every variant id ``v`` the value
``E_v = -ln(u_v)``, where ``u_v`` comes from SHA-256 of the caller key and the
id. Read as a random function, SHA-256 makes the ``E_v`` independent
exponential variables of rate 1, one per id, and the *same* ``E_v`` serves the
old and the new configuration as long as the caller key and the id are the
same. The old arm is the id with the smallest ``E_v / a_v`` (old weights
``a``), the new arm the one with the smallest ``E_v / b_v`` (new weights ``b``;
a missing id has weight 0 and takes no part).

:func:`same_key` integrates that race exactly. With ``t = E_j / E_i`` the
chance that ``i`` wins the old race and ``j`` the new one is

    P(i, j) = integral over t from a_j / a_i to b_j / b_i of dt / H(t)^2,
    H(t) = sum over every id k of max(a_k / a_i, t * b_k / b_j),

and ``P(i, i) = 1 / sum_k max(a_k / a_i, b_k / b_i)``. ``H`` is piecewise linear
in ``t`` (one break per id), so each piece integrates in closed form and the
result is a rational number, computed here with :class:`fractions.Fraction`.
This is not the smallest movement the new shares allow: a single weight edit,
an added arm or a paused arm moves exactly the minimum, but an edit of several
weights at once can move more, and the integral says exactly how much.

When the caller key itself changes (another experiment name, another sticky
value, another TTL window) the two races are independent: ``P(i, j) = p_i q_j``
(:func:`independent`). :func:`kept_key_share` gives the share of callers
whose key survives a ``sticky_ttl`` edit at one instant.

The shares are exact for SHA-256 as a random function, up to the rounding of
``u`` to 53 bits (below 10^-15) and, for :func:`kept_key_share`, the modulo
bias of the TTL offset (below lcm(T_old, T_new) / 2^64).
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from math import floor, gcd

__all__ = ["Joint", "independent", "kept_key_share", "same_key", "shares"]

Variants = Sequence[tuple[str, int]]  # declared (id, weight) pairs
Joint = dict[tuple[str, str], Fraction]  # (old arm, new arm) -> share of callers

_ZERO = Fraction(0)


def shares(variants: Variants) -> dict[str, Fraction]:
    """Each racing id's share of callers, ``w / sum(w)``."""
    total = sum(w for _, w in variants)
    return {vid: Fraction(w, total) for vid, w in variants if w > 0}


def independent(old: Variants, new: Variants) -> Joint:
    """The joint shares of two races on unrelated caller keys."""
    p, q = shares(old), shares(new)
    return {(i, j): pi * qj for i, pi in p.items() for j, qj in q.items()}


def same_key(old: Variants, new: Variants) -> Joint:
    """The joint shares of the old and new race on the same caller key (zero cells left out)."""
    ids = list(dict.fromkeys([vid for vid, _ in old] + [vid for vid, _ in new]))
    a = {vid: 0 for vid in ids} | {vid: w for vid, w in old}
    b = {vid: 0 for vid in ids} | {vid: w for vid, w in new}
    joint: Joint = {}
    for i in ids:
        if a[i] == 0:
            continue
        for j in ids:
            if b[j] == 0:
                continue
            share = _stay(ids, a, b, i) if i == j else _move(ids, a, b, i, j)
            if share:
                joint[(i, j)] = share
    return joint


def _stay(ids: list[str], a: dict[str, int], b: dict[str, int], i: str) -> Fraction:
    """P(i wins both races) = 1 / sum_k max(a_k / a_i, b_k / b_i)."""
    return Fraction(1) / sum((max(Fraction(a[k], a[i]), Fraction(b[k], b[i])) for k in ids), Fraction(0))


def _move(ids: list[str], a: dict[str, int], b: dict[str, int], i: str, j: str) -> Fraction:
    """P(i wins the old race and j != i the new one), integrated piece by piece."""
    start = Fraction(a[j], a[i])
    end = Fraction(b[j], b[i]) if b[i] else None  # None: unbounded (i left the race)
    if end is not None and end <= start:
        return _ZERO
    # Id k contributes a_k / a_i below its break (a_k / a_i) * (b_j / b_k) and
    # t * b_k / b_j above it; ids with b_k = 0 never break, with a_k = 0 always have.
    breaks: list[tuple[Fraction, Fraction, Fraction]] = []  # (break, constant lost, slope gained)
    alpha = beta = _ZERO
    for k in ids:
        const, slope = Fraction(a[k], a[i]), Fraction(b[k], b[j])
        if b[k] == 0:
            alpha += const
        elif a[k] == 0:
            beta += slope
        else:
            at = const / slope
            if at <= start:
                beta += slope
            else:
                alpha += const
                breaks.append((at, const, slope))
    total = _ZERO
    lo = start
    for at, const, slope in sorted(breaks):
        if end is not None and at >= end:
            break
        total += _piece(alpha, beta, lo, at)
        alpha, beta, lo = alpha - const, beta + slope, at
    return total + _piece(alpha, beta, lo, end)


def _piece(alpha: Fraction, beta: Fraction, lo: Fraction, hi: Fraction | None) -> Fraction:
    """The integral of dt / (alpha + beta t)^2 from lo to hi (None: infinity); beta > 0
    on every piece, since j's own term is t from the start on."""
    head = 1 / (beta * (alpha + beta * lo))
    return head if hi is None else head - 1 / (beta * (alpha + beta * hi))


def kept_key_share(old_ttl: int | None, new_ttl: int | None, unix_time: float) -> Fraction:
    """The share of sticky values whose caller key is the same under both TTLs at ``unix_time``.

    A TTL window enters the key, so the key survives only when the window
    number does: ``floor((t + X mod T) / T)`` with the same ``X`` (the first
    8 bytes of the un-windowed key) under both TTLs. Without a TTL on exactly
    one side no key survives; with the same TTL (or none) every key does.
    """
    if old_ttl == new_ttl:
        return Fraction(1)
    if old_ttl is None or new_ttl is None:
        return _ZERO
    t = floor(unix_time)
    q1, r1 = divmod(t, old_ttl)
    q2, r2 = divmod(t, new_ttl)
    # The window is q + 1 when the offset reaches T - r, else q.
    sides1 = ((q1, 0, old_ttl - r1), (q1 + 1, old_ttl - r1, old_ttl))
    sides2 = ((q2, 0, new_ttl - r2), (q2 + 1, new_ttl - r2, new_ttl))
    g = gcd(old_ttl, new_ttl)
    period = old_ttl // g * new_ttl
    count = sum(
        _pairs(lo1, hi1, lo2, hi2, g)
        for w1, lo1, hi1 in sides1
        for w2, lo2, hi2 in sides2
        if w1 == w2
    )
    return Fraction(count, period)


def _pairs(lo1: int, hi1: int, lo2: int, hi2: int, g: int) -> int:
    """How many (x, y) in [lo1, hi1) x [lo2, hi2) have x = y mod g: by the Chinese
    remainder theorem, the residues mod lcm(T1, T2) with those two offsets."""
    m1, s1 = divmod(hi1 - lo1, g)
    m2, s2 = divmod(hi2 - lo2, g)
    # Residue c occurs m + 1 times in the interval for c in a cyclic run of s
    # residues from lo mod g, m times otherwise.
    start1, start2 = lo1 % g, lo2 % g
    both = sum(
        max(0, min(start1 + s1, start2 + shift + s2) - max(start1, start2 + shift)) for shift in (-g, 0, g)
    )
    return g * m1 * m2 + m1 * s2 + m2 * s1 + both
