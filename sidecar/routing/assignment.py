"""Sticky variant assignment for model experiments.

Implements the published ``mr-exp-v1`` algorithm (see ``docs/assignment.md``):
a weighted rendezvous race ("exponential race") keyed by SHA-256.

    caller = SHA-256("mr-exp-v1" 0x00 experiment 0x00 sticky_value)      # UTF-8
    if sticky_ttl (seconds T):
        offset = uint64_be(caller[0:8]) mod T
        window = floor((unix_time + offset) / T)
        caller = SHA-256(caller || uint64_be(window))
    for each variant with weight w > 0:
        h     = SHA-256(caller || variant_id)                              # UTF-8
        u     = ((uint64_be(h[0:8]) >> 11) + 0.5) / 2^53                   # binary64
        score = -ln(u) / w
    smallest score wins; exact ties go to the earlier-declared variant.

Requests without a sticky value (``None`` or blank) run the same race with each
``u`` derived from 8 bytes of the operating system's random source.

The module is pure apart from that random source (and ``time.time()`` when a
TTL is used without an explicit time). For the hot path build a :class:`Race`
once per configuration snapshot and call :meth:`Race.assign` (full result) or
:meth:`Race.pick` (winning index only); :func:`assign` is a convenience
wrapper that caches races and salt prefixes.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import os
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

__all__ = [
    "ALGORITHM",
    "Assignment",
    "Race",
    "Score",
    "assign",
    "caller_key",
    "next_boundary",
    "salt_prefix",
]

ALGORITHM = "mr-exp-v1"

_DOMAIN = ALGORITHM.encode("ascii") + b"\x00"
_U64 = struct.Struct(">Q")
_unpack_u64 = _U64.unpack_from
_pack_u64 = _U64.pack
_sha256 = hashlib.sha256
_log = math.log
_floor = math.floor
_INF = math.inf
_NAN = math.nan
_TWO_POW_53 = 9007199254740992.0  # 2.0**53, exact
PICKED_LIMIT = 16_384  # callers whose winner one Race remembers before starting over
CALLERS_LIMIT = 16_384  # (experiment, sticky value) pairs whose un-windowed key is remembered
REMEMBERED_STICKY = 256  # the longest sticky value remembered: the memory stays bounded in bytes too
_MAX_WEIGHT = 1 << 53  # weights must be exactly representable as binary64
_MAX_U64 = 1 << 64


@dataclass(frozen=True, slots=True)
class Score:
    """One variant's entry in the race.

    ``u`` is NaN and ``score`` is +inf for weight-0 variants (not in the race).
    """

    variant_id: str
    weight: int
    u: float
    score: float


@dataclass(frozen=True, slots=True)
class Assignment:
    variant_index: int  # index into the declared variants
    variant_id: str
    sticky: bool  # False when drawn at random
    window: int | None  # TTL window index used, None without TTL (or random)
    scores: tuple[Score, ...]  # one per declared variant, declared order


# --------------------------------------------------------------------------- helpers


def salt_prefix(experiment: str) -> bytes:
    """``"mr-exp-v1" 0x00 experiment 0x00`` as bytes (precompute per experiment)."""
    return _DOMAIN + experiment.encode("utf-8") + b"\x00"


_cached_prefix = lru_cache(maxsize=4096)(salt_prefix)


def _hashed(prefix: bytes, sticky_value: str) -> bytes:
    return _sha256(prefix + sticky_value.encode("utf-8")).digest()


_remembered = lru_cache(maxsize=CALLERS_LIMIT)(_hashed)


def _caller0(prefix: bytes, sticky_value: str) -> bytes:
    """``SHA-256(prefix || sticky_value)``: the caller's key before any TTL
    window. A returning caller costs a lookup, not a hash; a sticky value is a
    client's to choose, so only short ones are remembered."""
    if len(sticky_value) > REMEMBERED_STICKY:
        return _hashed(prefix, sticky_value)
    return _remembered(prefix, sticky_value)


def _check_ttl(ttl_seconds: object) -> int:
    if type(ttl_seconds) is int and ttl_seconds > 0:
        return ttl_seconds
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int):
        raise TypeError(f"ttl_seconds must be a positive int or None, got {ttl_seconds!r}")
    raise ValueError(f"ttl_seconds must be > 0, got {ttl_seconds}")


def _window(caller0: bytes, ttl: int, unix_time: float) -> tuple[int, int]:
    """Return ``(offset, window)`` for a caller's un-windowed key.

    ``floor((t + offset) / T) == (floor(t) + offset) // T`` for integers
    ``offset`` and ``T > 0``, so this is exact for fractional times too.
    """
    offset = _unpack_u64(caller0)[0] % ttl
    try:
        whole = _floor(unix_time)
    except (OverflowError, ValueError, TypeError) as exc:
        raise ValueError(f"unix_time must be a finite number, got {unix_time!r}") from exc
    window = (whole + offset) // ttl
    if not 0 <= window < _MAX_U64:
        raise ValueError(f"unix_time {unix_time!r} gives window {window} outside uint64")
    return offset, window


def is_blank(sticky_value: str | None) -> bool:
    return sticky_value is None or not sticky_value or sticky_value.isspace()


# --------------------------------------------------------------------------- race


class Race:
    """Precomputed race over one declared variant list.

    Build once per configuration snapshot; immutable and safe to share.
    Experiment-agnostic: the experiment enters through ``prefix`` (see
    :func:`salt_prefix`).
    """

    __slots__ = ("variants", "_ids", "_racers", "_zero_scores", "_n", "_n_racing", "_picked")

    def __init__(self, variants: Sequence[tuple[str, int]]) -> None:
        ids: list[str] = []
        weights: list[int] = []
        for item in variants:
            try:
                vid, weight = item
            except (TypeError, ValueError) as exc:
                raise TypeError(f"variant must be an (id, weight) pair, got {item!r}") from exc
            if not isinstance(vid, str):
                raise TypeError(f"variant id must be str, got {vid!r}")
            ids.append(vid)
            weights.append(_check_weight(vid, weight))
        racers = tuple(
            (i, vid, vid.encode("utf-8"), w, float(w))
            for i, (vid, w) in enumerate(zip(ids, weights))
            if w > 0
        )
        if not racers:
            raise ValueError("at least one variant must have a weight > 0")
        self.variants: tuple[tuple[str, int], ...] = tuple(zip(ids, weights))
        self._ids = tuple(ids)
        self._racers = racers
        # Weight-0 entries never change: build their Score objects once.
        self._zero_scores = tuple(
            None if w > 0 else Score(vid, 0, _NAN, _INF) for vid, w in zip(ids, weights)
        )
        self._n = len(ids)
        self._n_racing = len(racers)
        self._picked: dict[bytes, int] = {}  # caller key -> winner (a pure function of it; bounded)

    def __repr__(self) -> str:
        return f"Race({list(self.variants)!r})"

    # -- keys ---------------------------------------------------------------

    @staticmethod
    def caller_key(
        prefix: bytes, sticky_value: str, ttl_seconds: int | None, unix_time: float | None
    ) -> tuple[bytes, int | None]:
        caller = _caller0(prefix, sticky_value)
        if ttl_seconds is None:
            return caller, None
        ttl = _check_ttl(ttl_seconds)
        _, window = _window(caller, ttl, time.time() if unix_time is None else unix_time)
        return _sha256(caller + _pack_u64(window)).digest(), window

    def _random_block(self, random_bytes: Callable[[int], bytes]) -> bytes:
        need = 8 * self._n_racing
        block = random_bytes(need)
        if len(block) != need:
            raise ValueError(f"random_bytes({need}) returned {len(block)} bytes")
        return block

    # -- hot paths ----------------------------------------------------------

    def pick(
        self,
        prefix: bytes,
        sticky_value: str | None,
        ttl_seconds: int | None = None,
        now: float | None = None,
        random_bytes: Callable[[int], bytes] = os.urandom,
    ) -> int:
        """Winning variant index only (no per-variant objects allocated)."""
        best = -1
        best_score = _INF
        if is_blank(sticky_value):
            block = self._random_block(random_bytes)
            k = 0
            for i, _vid, _enc, _w, fw in self._racers:
                s = -_log(((_unpack_u64(block, k)[0] >> 11) + 0.5) / _TWO_POW_53) / fw
                k += 8
                if s < best_score:  # strict: exact ties keep the earlier-declared variant
                    best, best_score = i, s
            return best
        caller, _ = self.caller_key(prefix, sticky_value, ttl_seconds, now)  # type: ignore[arg-type]
        return self.pick_key(caller)

    def pick_key(self, caller: bytes) -> int:
        """Winning variant index for a caller key from :meth:`caller_key`
        (remembered: a returning caller costs a dict lookup, not a hash and a
        logarithm per variant)."""
        best = self._picked.get(caller, -1)
        if best >= 0:
            return best
        best_score = _INF
        for i, _vid, enc, _w, fw in self._racers:
            m = _unpack_u64(_sha256(caller + enc).digest())[0] >> 11
            s = -_log((m + 0.5) / _TWO_POW_53) / fw
            if s < best_score:  # strict: exact ties keep the earlier-declared variant
                best, best_score = i, s
        if len(self._picked) >= PICKED_LIMIT:
            self._picked.clear()
        self._picked[caller] = best
        return best

    def assign(
        self,
        prefix: bytes,
        sticky_value: str | None,
        ttl_seconds: int | None = None,
        now: float | None = None,
        random_bytes: Callable[[int], bytes] = os.urandom,
    ) -> Assignment:
        """Full assignment with the score table."""
        scores: list[Score | None] = list(self._zero_scores)
        best = -1
        best_score = _INF
        if is_blank(sticky_value):
            sticky = False
            window = None
            block = self._random_block(random_bytes)
            k = 0
            for i, vid, _enc, w, fw in self._racers:
                u = ((_unpack_u64(block, k)[0] >> 11) + 0.5) / _TWO_POW_53
                k += 8
                s = -_log(u) / fw
                scores[i] = Score(vid, w, u, s)
                if s < best_score:  # strict: exact ties keep the earlier-declared variant
                    best, best_score = i, s
        else:
            sticky = True
            caller, window = self.caller_key(prefix, sticky_value, ttl_seconds, now)  # type: ignore[arg-type]
            for i, vid, enc, w, fw in self._racers:
                u = ((_unpack_u64(_sha256(caller + enc).digest())[0] >> 11) + 0.5) / _TWO_POW_53
                s = -_log(u) / fw
                scores[i] = Score(vid, w, u, s)
                if s < best_score:  # strict: exact ties keep the earlier-declared variant
                    best, best_score = i, s
        return Assignment(best, self._ids[best], sticky, window, tuple(scores))  # type: ignore[arg-type]


def _check_weight(vid: str, weight: object) -> int:
    # Any integral number is accepted (numpy ints, 1.0, True) so that configs that
    # compare equal also behave equally (the convenience cache relies on this).
    if type(weight) is int:
        w = weight
    elif isinstance(weight, numbers.Integral):
        w = int(weight)
    elif isinstance(weight, numbers.Real):
        if not (isinstance(weight, float) or hasattr(weight, "is_integer")) or not weight.is_integer():
            raise ValueError(f"weight of {vid!r} must be a whole number, got {weight!r}")
        w = int(math.trunc(weight))
    else:
        raise TypeError(f"weight of {vid!r} must be an integer, got {weight!r}")
    if not 0 <= w <= _MAX_WEIGHT:
        raise ValueError(f"weight of {vid!r} must be in [0, 2**53], got {weight!r}")
    return w


@lru_cache(maxsize=1024)
def _cached_race(variants: tuple[Any, ...]) -> Race:
    return Race(variants)


def _race_for(variants: Sequence[tuple[str, int]]) -> Race:
    key = variants if type(variants) is tuple else tuple(variants)
    try:
        hash(key)
    except TypeError:
        return Race(key)  # e.g. a list of lists: still valid, just not cacheable
    return _cached_race(key)


# --------------------------------------------------------------------------- public API


def caller_key(
    experiment: str, sticky_value: str, ttl_seconds: int | None, unix_time: float
) -> tuple[bytes, int | None]:
    """The 32-byte caller key that enters the race, and the TTL window (or None)."""
    return Race.caller_key(_cached_prefix(experiment), sticky_value, ttl_seconds, unix_time)


def assign(
    experiment: str,
    variants: Sequence[tuple[str, int]],
    sticky_value: str | None,
    *,
    ttl_seconds: int | None = None,
    unix_time: float | None = None,
    random_bytes: Callable[[int], bytes] = os.urandom,
) -> Assignment:
    """Assign a request to one of ``variants`` (declared ``(id, weight)`` pairs).

    ``sticky_value`` None, empty or whitespace-only draws at random from
    ``random_bytes`` (8 bytes per positive-weight variant, one call).
    ``unix_time`` defaults to ``time.time()`` and only matters with a TTL.
    Raises ValueError if no weight is positive.
    """
    return _race_for(variants).assign(
        _cached_prefix(experiment), sticky_value, ttl_seconds, unix_time, random_bytes
    )


def next_boundary(experiment: str, sticky_value: str, ttl_seconds: int, unix_time: float) -> float:
    """Unix time at which this caller's current TTL window ends (the next window starts)."""
    ttl = _check_ttl(ttl_seconds)
    caller0 = _caller0(_cached_prefix(experiment), sticky_value)
    offset, window = _window(caller0, ttl, unix_time)
    return float((window + 1) * ttl - offset)
