"""Tests for sticky variant assignment (sidecar/routing/assignment.py, docs/assignment.md).

The reference implementation below is written straight from the published
algorithm text and deliberately shares no code with the production module:
exact rationals for ``u`` and the TTL window, 60-digit decimal logarithms for
the scores.
"""

from __future__ import annotations

import hashlib
import math
import re
from decimal import Context, Decimal
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from sidecar.routing.assignment import Assignment, Race, Score, assign, caller_key, next_boundary, salt_prefix
from tests.support.properties import budget

DOCS = Path(__file__).resolve().parents[2] / "docs" / "assignment.md"

# --------------------------------------------------------------------------- reference

_DEC = Context(prec=60)


def ref_caller(experiment: str, sticky: str, ttl: int | None, now) -> tuple[bytes, int | None]:
    data = b"mr-exp-v1" + b"\x00" + experiment.encode("utf-8") + b"\x00" + sticky.encode("utf-8")
    caller = hashlib.sha256(data).digest()
    if ttl is None:
        return caller, None
    offset = int.from_bytes(caller[0:8], "big") % ttl
    window = math.floor((Fraction(now) + offset) / ttl)  # exact rational arithmetic
    caller = hashlib.sha256(caller + window.to_bytes(8, "big")).digest()
    return caller, window


def ref_u(eight_bytes: bytes) -> Fraction:
    m = int.from_bytes(eight_bytes, "big") >> 11
    return (Fraction(m) + Fraction(1, 2)) / 2**53


def ref_score(u: Fraction, weight: int) -> Decimal:
    ln_u = _DEC.divide(Decimal(u.numerator), Decimal(u.denominator)).ln(_DEC)
    return _DEC.divide(-ln_u, Decimal(weight))


def ref_race(variants, u_for):
    """Return (winner index, {index: (u, score)}) for the declared variants.

    ``u_for(k, variant_id)`` gives the exact u of the k-th positive-weight variant.
    """
    table = {}
    k = 0
    for idx, (vid, w) in enumerate(variants):
        if w > 0:
            u = u_for(k, vid)
            k += 1
            table[idx] = (u, ref_score(u, w))
    winner = min(table, key=lambda idx: (table[idx][1], idx))  # exact tie -> earlier declared
    return winner, table


def ref_assign(experiment, variants, sticky, ttl=None, now=None):
    caller, window = ref_caller(experiment, sticky, ttl, now)

    def u_for(_k, vid):
        return ref_u(hashlib.sha256(caller + vid.encode("utf-8")).digest()[0:8])

    winner, table = ref_race(variants, u_for)
    return winner, window, table


def ref_share_churn(weights) -> Fraction:
    total = sum(weights)
    return 1 - sum(Fraction(w, total) ** 2 for w in weights)


# --------------------------------------------------------------------------- strategies

unicode_text = st.text(alphabet=st.characters(codec="utf-8"), max_size=24)
sticky_values = st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=40).filter(
    lambda s: s.strip() != ""
)
ttls = st.integers(min_value=60, max_value=365 * 86400)
times = st.one_of(
    st.integers(min_value=0, max_value=4_000_000_000),
    st.floats(min_value=0, max_value=4e9, allow_nan=False, allow_infinity=False),
)


@st.composite
def variant_lists(draw, min_size=1, max_size=16, ids=unicode_text, max_weight=1_000_000):
    vids = draw(st.lists(ids, min_size=min_size, max_size=max_size))
    weights = [draw(st.integers(min_value=0, max_value=max_weight)) for _ in vids]
    if not any(weights):
        weights[draw(st.integers(0, len(vids) - 1))] = draw(st.integers(1, max_weight))
    return list(zip(vids, weights))


def check_against_reference(got: Assignment, variants, winner, table) -> None:
    assert got.variant_index == winner
    assert got.variant_id == variants[winner][0]
    assert len(got.scores) == len(variants)
    for idx, ((vid, w), sc) in enumerate(zip(variants, got.scores)):
        assert isinstance(sc, Score)
        assert sc.variant_id == vid and sc.weight == w
        if w == 0:
            assert sc.score == math.inf and math.isnan(sc.u)
            continue
        u, score = table[idx]
        assert sc.u == float(u)  # correctly rounded exact value
        # -ln(u)/w in binary64: a few ulps relative, plus the rounding of u near 1.
        assert math.isclose(sc.score, float(score), rel_tol=1e-15, abs_tol=1e-15 / w)


# --------------------------------------------------------------------------- 1. reference


@settings(max_examples=budget(2500), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    experiment=unicode_text,
    sticky=sticky_values,
    variants=variant_lists(),
    ttl=st.one_of(st.none(), ttls),
    now=times,
)
def test_matches_reference_sticky(experiment, sticky, variants, ttl, now):
    got = assign(experiment, variants, sticky, ttl_seconds=ttl, unix_time=now)
    winner, window, table = ref_assign(experiment, variants, sticky, ttl, now)
    assert got.sticky is True
    assert got.window == window
    check_against_reference(got, variants, winner, table)
    key, key_window = caller_key(experiment, sticky, ttl, now)
    assert (key, key_window) == ref_caller(experiment, sticky, ttl, now)
    # The Race fast paths agree with the public function.
    race = Race(variants)
    assert race.assign(salt_prefix(experiment), sticky, ttl, now) == got
    assert race.pick(salt_prefix(experiment), sticky, ttl, now) == winner


@settings(max_examples=budget(500), deadline=None)
@given(
    experiment=unicode_text,
    variants=variant_lists(),
    blank=st.sampled_from([None, "", " ", "\t\n ", "\u3000", "\u00a0"]),
    stream=st.binary(min_size=8 * 16, max_size=8 * 16),
    ttl=st.one_of(st.none(), ttls),
)
def test_matches_reference_random(experiment, variants, blank, stream, ttl):
    calls = []

    def fake_random(n):
        calls.append(n)
        return stream[:n]

    got = assign(experiment, variants, blank, ttl_seconds=ttl, unix_time=1.7e9, random_bytes=fake_random)
    n_pos = sum(1 for _, w in variants if w > 0)
    assert calls == [8 * n_pos]  # one draw of 8 bytes per positive-weight variant
    winner, table = ref_race(variants, lambda k, _vid: ref_u(stream[8 * k : 8 * k + 8]))
    assert got.sticky is False and got.window is None
    check_against_reference(got, variants, winner, table)


def _doc_tables(text: str, heading: str) -> list[list[str]]:
    """Rows (cells, backticks stripped) of the first table after ``heading``."""
    lines = text.split(heading, 1)[1].splitlines()
    rows, started = [], False
    for line in lines:
        line = line.strip()
        if line.startswith("|"):
            started = True
            cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
            rows.append(cells)
        elif started:
            break
    header, sep, *body = rows
    assert set("".join(sep)) <= set("-: ")
    return [header] + body


def _doc_vectors():
    header, *rows = _doc_tables(DOCS.read_text(encoding="utf-8"), "## Test vectors")
    assert header[:3] == ["#", "experiment", "sticky value"]
    out = []
    for cells in rows:
        num, exp, sticky, variants_s, ttl_s, time_s, offset_s, window_s, key_hex, winner = cells
        variants = []
        for part in variants_s.split(", "):
            vid, w = part.rsplit(":", 1)
            variants.append((vid, int(w)))
        na = "—"
        out.append(
            dict(
                num=int(num),
                experiment=exp,
                sticky=sticky,
                variants=variants,
                ttl=None if ttl_s == na else int(ttl_s),
                now=None if time_s == na else (float(time_s) if "." in time_s else int(time_s)),
                offset=None if offset_s == na else int(offset_s),
                window=None if window_s == na else int(window_s),
                key_hex=key_hex,
                winner=winner,
            )
        )
    return out


def test_docs_vector_table_covers_required_cases():
    rows = _doc_vectors()
    assert len(rows) >= 8
    assert any(r["variants"] == [("control", 90), ("candidate", 10)] and r["ttl"] is None for r in rows)
    assert any(len(r["variants"]) == 3 for r in rows)
    assert any(any(w == 0 for _, w in r["variants"]) for r in rows)
    assert any(not r["experiment"].isascii() and not r["sticky"].isascii() for r in rows)
    week = [r for r in rows if r["ttl"] == 7 * 86400]
    # one caller seen on both sides of its own window boundary
    pairs = [
        (a, b)
        for a in week
        for b in week
        if (a["experiment"], a["sticky"]) == (b["experiment"], b["sticky"])
        and a["now"] < next_boundary(a["experiment"], a["sticky"], a["ttl"], a["now"]) <= b["now"]
        and b["window"] == a["window"] + 1
    ]
    assert pairs


@pytest.mark.parametrize("row", _doc_vectors(), ids=lambda r: f"row{r['num']}")
def test_docs_vectors_match(row):
    got = assign(row["experiment"], row["variants"], row["sticky"], ttl_seconds=row["ttl"], unix_time=row["now"])
    assert got.variant_id == row["winner"]
    assert got.window == row["window"]
    key, window = caller_key(row["experiment"], row["sticky"], row["ttl"], row["now"])
    assert key[:8].hex() == row["key_hex"]
    assert window == row["window"]
    # and independently, from the reference
    winner, ref_window, _ = ref_assign(row["experiment"], row["variants"], row["sticky"], row["ttl"], row["now"])
    assert row["variants"][winner][0] == row["winner"] and ref_window == row["window"]
    if row["ttl"] is not None:
        ttl = row["ttl"]
        raw = hashlib.sha256(salt_prefix(row["experiment"]) + row["sticky"].encode()).digest()
        assert int.from_bytes(raw[:8], "big") % ttl == row["offset"]
        boundary = next_boundary(row["experiment"], row["sticky"], ttl, row["now"])
        assert boundary == (row["window"] + 1) * ttl - row["offset"]
        assert boundary - ttl <= row["now"] < boundary


def test_docs_full_score_table():
    text = DOCS.read_text(encoding="utf-8")
    section = text.split("### Full race for row ", 1)[1]
    num = int(re.match(r"\d+", section).group())
    row = next(r for r in _doc_vectors() if r["num"] == num)
    full_key = re.search(r"`([0-9a-f]{64})`", section).group(1)
    header, *rows = _doc_tables(section, "\n")
    assert header == ["variant", "weight", "h[0:8]", "u", "score"]
    got = assign(row["experiment"], row["variants"], row["sticky"], ttl_seconds=row["ttl"], unix_time=row["now"])
    key, _ = caller_key(row["experiment"], row["sticky"], row["ttl"], row["now"])
    assert key.hex() == full_key
    assert len(rows) == len(got.scores)
    for (vid, weight, h8, u_s, score_s), sc in zip(rows, got.scores):
        assert (vid, int(weight)) == (sc.variant_id, sc.weight)
        assert hashlib.sha256(key + vid.encode()).digest()[:8].hex() == h8
        assert f"{sc.u:.12g}" == u_s
        assert f"{sc.score:.12g}" == score_s


def test_docs_churn_table():
    text = DOCS.read_text(encoding="utf-8")
    header, *rows = _doc_tables(text, "churn = 1 - sum(share_i^2)")
    splits = {}
    for split, pct in rows:
        splits[split] = pct
        weights = [int(x) for x in split.split("/")]
        assert ref_share_churn(weights) * 100 == int(pct.rstrip("%"))
    assert splits["90/10"] == "18%" and splits["50/50"] == "50%"


def test_docs_python_sketch_matches_vectors():
    text = DOCS.read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    sketch = next(b for b in blocks if "def assign(" in b)
    ns: dict = {}
    exec(sketch, ns)
    for row in _doc_vectors():
        assert ns["assign"](row["experiment"], row["variants"], row["sticky"], row["ttl"], row["now"]) == row["winner"]


# --------------------------------------------------------------------------- 2. minimal movement

CALLERS = [f"caller-{i}" for i in range(3000)]
MOVE = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
unique_variants = variant_lists(min_size=1, max_size=6, ids=st.just(""), max_weight=1000).map(
    lambda vs: [(f"v{i}", w) for i, (_, w) in enumerate(vs)]
)
ttl_and_time = st.one_of(st.none(), st.tuples(ttls, st.integers(0, 4_000_000_000)))


def arms(experiment, variants, ttl_time):
    ttl, now = ttl_time if ttl_time else (None, None)
    return [assign(experiment, variants, c, ttl_seconds=ttl, unix_time=now).variant_id for c in CALLERS]


def with_weight(variants, index, weight):
    out = list(variants)
    out[index] = (out[index][0], weight)
    return out


@MOVE
@given(experiment=unicode_text, variants=unique_variants, data=st.data(), tt=ttl_and_time)
def test_raising_a_weight_only_moves_callers_into_that_arm(experiment, variants, data, tt):
    i = data.draw(st.integers(0, len(variants) - 1))
    new_w = data.draw(st.integers(variants[i][1] + 1, 2000))
    target = variants[i][0]
    before = arms(experiment, variants, tt)
    after = arms(experiment, with_weight(variants, i, new_w), tt)
    for b, a in zip(before, after):
        assert a == b or a == target


@MOVE
@given(experiment=unicode_text, variants=unique_variants, data=st.data(), tt=ttl_and_time)
def test_lowering_a_weight_only_moves_callers_out_of_that_arm(experiment, variants, data, tt):
    i = data.draw(st.integers(0, len(variants) - 1))
    assume(variants[i][1] > 0)
    new_w = data.draw(st.integers(0, variants[i][1] - 1))
    lowered = with_weight(variants, i, new_w)
    assume(any(w > 0 for _, w in lowered))
    target = variants[i][0]
    before = arms(experiment, variants, tt)
    after = arms(experiment, lowered, tt)
    for b, a in zip(before, after):
        assert a == b or b == target


@MOVE
@given(experiment=unicode_text, variants=unique_variants, data=st.data(), tt=ttl_and_time)
def test_adding_an_arm_only_moves_callers_into_it(experiment, variants, data, tt):
    pos = data.draw(st.integers(0, len(variants)))
    new = ("new-arm", data.draw(st.integers(1, 1000)))
    extended = variants[:pos] + [new] + variants[pos:]
    before = arms(experiment, variants, tt)
    after = arms(experiment, extended, tt)
    for b, a in zip(before, after):
        assert a == b or a == "new-arm"


@MOVE
@given(experiment=unicode_text, variants=unique_variants, data=st.data(), tt=ttl_and_time)
def test_zeroing_an_arm_only_moves_its_callers_out(experiment, variants, data, tt):
    i = data.draw(st.integers(0, len(variants) - 1))
    zeroed = with_weight(variants, i, 0)
    assume(any(w > 0 for _, w in zeroed))
    target = variants[i][0]
    before = arms(experiment, variants, tt)
    after = arms(experiment, zeroed, tt)
    for b, a in zip(before, after):
        assert a != target
        assert a == b or b == target


# --------------------------------------------------------------------------- 3. statistics
#
# Each check is a binomial proportion over N independent callers; the tolerance
# is 4.5 standard errors sqrt(p(1-p)/N) (two-sided false-alarm rate ~7e-6 per
# check), so the tests do not depend on which synthetic callers are used.

N = 20_000
Z = 4.5


def assert_proportion(count: int, n: int, p: float) -> None:
    se = math.sqrt(p * (1 - p) / n)
    observed = count / n
    assert abs(observed - p) <= Z * se, f"observed {observed:.5f}, expected {p:.5f} +/- {Z * se:.5f}"


def synthetic_callers(tag: str, n: int = N) -> list[str]:
    return [f"{tag}-{i:06d}" for i in range(n)]


@pytest.mark.parametrize("weights", [(90, 10), (70, 20, 10)])
@pytest.mark.parametrize("experiment", ["exp-alpha", "модель-β"])
def test_sticky_shares_follow_weights(weights, experiment):
    variants = [(f"arm{i}", w) for i, w in enumerate(weights)]
    race = Race(variants)
    prefix = salt_prefix(experiment)
    counts = [0] * len(variants)
    for c in synthetic_callers("user"):
        counts[race.pick(prefix, c)] += 1
    for count, w in zip(counts, weights):
        assert_proportion(count, N, w / sum(weights))


def test_weight_edit_90_10_to_80_20_moves_about_ten_percent_all_into_candidate():
    callers = synthetic_callers("acct")
    before = [assign("checkout", [("control", 90), ("candidate", 10)], c).variant_id for c in callers]
    after = [assign("checkout", [("control", 80), ("candidate", 20)], c).variant_id for c in callers]
    moved = [(b, a) for b, a in zip(before, after) if a != b]
    assert all(m == ("control", "candidate") for m in moved)
    assert_proportion(len(moved), N, 0.10)
    assert_proportion(after.count("candidate"), N, 0.20)


@pytest.mark.parametrize("weights", [(90, 10), (50, 50), (60, 30, 10)])
def test_ttl_churn_at_each_callers_boundary(weights):
    ttl = 7 * 86400
    t0 = 1_767_225_600.25
    variants = [(f"arm{i}", w) for i, w in enumerate(weights)]
    changed = 0
    for c in synthetic_callers("sess"):
        b = next_boundary("churn-exp", c, ttl, t0)
        assert t0 < b <= t0 + ttl and b == int(b)
        at_t0 = assign("churn-exp", variants, c, ttl_seconds=ttl, unix_time=t0)
        just_before = assign("churn-exp", variants, c, ttl_seconds=ttl, unix_time=b - 0.001)
        at_b = assign("churn-exp", variants, c, ttl_seconds=ttl, unix_time=b)
        assert just_before.window == at_t0.window and just_before.variant_index == at_t0.variant_index
        assert at_b.window == at_t0.window + 1
        assert next_boundary("churn-exp", c, ttl, b) == b + ttl
        changed += at_b.variant_index != just_before.variant_index
    assert_proportion(changed, N, float(ref_share_churn(weights)))


def test_ttl_boundaries_are_spread_evenly_over_the_window():
    ttl = 86400
    t0 = 1_767_225_600
    within_quarter = sum(next_boundary("spread", c, ttl, t0) - t0 <= ttl / 4 for c in synthetic_callers("s"))
    assert_proportion(within_quarter, N, 0.25)


@pytest.mark.parametrize("weights", [(90, 10), (70, 20, 10)])
@pytest.mark.parametrize("sticky", [None, "", "   ", "\t"])
def test_random_draws_follow_weights(weights, sticky):
    variants = [(f"arm{i}", w) for i, w in enumerate(weights)]
    race = Race(variants)
    prefix = salt_prefix("random-exp")
    counts = [0] * len(variants)
    n = N if sticky is None else N // 4
    for _ in range(n):
        counts[race.pick(prefix, sticky)] += 1
    for count, w in zip(counts, weights):
        assert_proportion(count, n, w / sum(weights))
    a = assign("random-exp", variants, sticky, ttl_seconds=3600)
    assert a.sticky is False and a.window is None


def test_random_draws_are_not_sticky():
    variants = [("a", 1), ("b", 1)]
    seen = {assign("x", variants, None).variant_id for _ in range(200)}
    assert seen == {"a", "b"}  # fails with probability 2**-199


# --------------------------------------------------------------------------- 4. edge cases


def const_bytes(block: bytes):
    return lambda n: (block * (n // len(block) + 1))[:n]


def test_exact_tie_goes_to_earlier_declared_variant():
    # Identical u for every variant -> equal weights tie exactly.
    for fill in (b"\x00", b"\x5a", b"\xff"):
        rb = const_bytes(fill * 8)
        assert assign("e", [("a", 3), ("b", 3), ("c", 3)], None, random_bytes=rb).variant_index == 0
        assert assign("e", [("z", 0), ("a", 3), ("b", 3)], None, random_bytes=rb).variant_index == 1
    # Same u, larger weight -> smaller score, so no tie.
    rb = const_bytes(b"\x5a" * 8)
    assert assign("e", [("a", 1), ("b", 2)], None, random_bytes=rb).variant_index == 1
    # Duplicate ids hash identically: sticky exact tie.
    for c in CALLERS[:200]:
        assert assign("e", [("same", 5), ("same", 5)], c).variant_index == 0
        assert assign("e", [("x", 1), ("same", 5), ("same", 5)], c).variant_index in (0, 1)


def test_smallest_score_wins_regardless_of_declaration_order():
    # u near 1 -> score near 0 (wins); u tiny -> large score.
    near_one, tiny = b"\xff" * 7 + b"\x00", b"\x00" * 7 + b"\x01"
    assert assign("e", [("a", 1), ("b", 1)], None, random_bytes=lambda n: near_one + tiny).variant_index == 0
    assert assign("e", [("a", 1), ("b", 1)], None, random_bytes=lambda n: tiny + near_one).variant_index == 1


def test_u_extremes():
    lo = assign("e", [("a", 7)], None, random_bytes=const_bytes(b"\x00" * 8)).scores[0]
    assert lo.u == 2.0**-54 and lo.score == pytest.approx(54 * math.log(2) / 7, rel=1e-15)
    hi = assign("e", [("a", 7)], None, random_bytes=const_bytes(b"\xff" * 8)).scores[0]
    # (2^54 - 1) / 2^54 rounds (half to even) to exactly 1.0 in binary64.
    assert hi.u == 1.0 and hi.score == 0.0
    # m = 2^53 - 2: u = 1 - 1.5 * 2^-53 is halfway between 1 - 2^-53 (odd) and 1 - 2^-52 (even).
    mid = assign("e", [("a", 1)], None, random_bytes=const_bytes((((1 << 53) - 2) << 11).to_bytes(8, "big")))
    assert mid.scores[0].u == 1 - 2.0**-52 == float(ref_u((((1 << 53) - 2) << 11).to_bytes(8, "big")))
    # m = 2^53 - 3: u = 1 - 2.5 * 2^-53 is halfway between 1 - 2^-52 (even) and 1 - 3 * 2^-53.
    mid = assign("e", [("a", 1)], None, random_bytes=const_bytes((((1 << 53) - 3) << 11).to_bytes(8, "big")))
    assert mid.scores[0].u == 1 - 2.0**-52


@settings(max_examples=budget(200), deadline=None)
@given(experiment=unicode_text, sticky=sticky_values, variants=variant_lists(), ttl=st.one_of(st.none(), ttls))
def test_weight_zero_never_wins_and_winner_has_min_score(experiment, sticky, variants, ttl):
    got = assign(experiment, variants, sticky, ttl_seconds=ttl, unix_time=1.8e9)
    assert variants[got.variant_index][1] > 0
    assert got.scores[got.variant_index].score == min(s.score for s in got.scores)
    rnd = assign(experiment, variants, None)
    assert variants[rnd.variant_index][1] > 0


@settings(max_examples=budget(200), deadline=None)
@given(experiment=unicode_text, sticky=st.one_of(st.none(), sticky_values), n_zero=st.integers(0, 10), data=st.data())
def test_single_positive_variant_always_wins(experiment, sticky, n_zero, data):
    pos = data.draw(st.integers(0, n_zero))
    variants = [(f"z{i}", 0) for i in range(n_zero)]
    variants.insert(pos, ("only", data.draw(st.integers(1, 10**6))))
    got = assign(experiment, variants, sticky)
    assert got.variant_index == pos and got.variant_id == "only"
    assert got.sticky is (sticky is not None)


@pytest.mark.parametrize("variants", [[], [("a", 0)], [("a", 0), ("b", 0)], (("a", 0),)])
def test_no_positive_weight_is_rejected(variants):
    with pytest.raises(ValueError):
        assign("e", variants, "user")
    with pytest.raises(ValueError):
        assign("e", variants, None)
    with pytest.raises(ValueError):
        Race(variants)


def test_invalid_inputs():
    with pytest.raises(ValueError):
        assign("e", [("a", -1), ("b", 1)], "u")
    with pytest.raises(ValueError):
        assign("e", [("a", 1.5)], "u")
    with pytest.raises(ValueError):
        assign("e", [("a", 2**53 + 1)], "u")
    with pytest.raises(TypeError):
        assign("e", [("a", "1")], "u")
    with pytest.raises(TypeError):
        assign("e", [(1, 1)], "u")
    with pytest.raises(ValueError):
        assign("e", [("a", 1)], "u", ttl_seconds=0)
    with pytest.raises(TypeError):
        assign("e", [("a", 1)], "u", ttl_seconds=1.5)
    with pytest.raises(ValueError):
        assign("e", [("a", 1)], "u", ttl_seconds=60, unix_time=float("nan"))
    with pytest.raises(ValueError):
        assign("e", [("a", 1)], "\ud800")  # lone surrogate: not encodable as UTF-8
    with pytest.raises(ValueError):
        assign("e", [("a", 1)], None, random_bytes=lambda n: b"\x00" * (n - 1))
    with pytest.raises(ValueError):
        next_boundary("e", "u", 0, 0)


def test_api_shapes_and_defaults():
    variants = [("control", 90), ("paused", 0), ("candidate", 10)]
    got = assign("e", variants, "user-1")
    assert got == assign("e", tuple(variants), "user-1") == assign("e", [list(v) for v in variants], "user-1")
    assert got.window is None and got.sticky is True
    assert [s.variant_id for s in got.scores] == ["control", "paused", "candidate"]
    assert got.scores[1] == Score("paused", 0, got.scores[1].u, math.inf)
    # unix_time defaults to now, and only matters with a TTL
    ttl = 3600
    key_now, w_now = caller_key("e", "user-1", ttl, __import__("time").time())
    assert assign("e", variants, "user-1", ttl_seconds=ttl).window in (w_now, w_now + 1)
    # weights are relative
    scaled = [(v, w * 7) for v, w in variants]
    for c in CALLERS[:300]:
        assert assign("e", variants, c).variant_id == assign("e", scaled, c).variant_id
    # sticky values are used verbatim (no trimming)
    assert caller_key("e", " user-1", None, 0) != caller_key("e", "user-1", None, 0)


def test_callers_are_remembered_within_a_bound_of_entries_and_bytes():
    """A sticky value is the client's to choose (a header, a user field): the
    keys remembered for returning callers are capped in number, and a long
    value is hashed every time rather than kept."""
    from sidecar.routing import assignment as a

    prefix = a.salt_prefix("bound")
    a._remembered.cache_clear()
    short = "u" * a.REMEMBERED_STICKY
    assert a._caller0(prefix, short) == hashlib.sha256(prefix + short.encode()).digest()
    assert a._remembered.cache_info().currsize == 1
    long = "u" * (a.REMEMBERED_STICKY + 1)
    assert a._caller0(prefix, long) == hashlib.sha256(prefix + long.encode()).digest()
    assert a._remembered.cache_info().currsize == 1
    for i in range(a.CALLERS_LIMIT + 10):
        a._caller0(prefix, f"caller-{i}")
    assert a._remembered.cache_info().currsize == a.CALLERS_LIMIT
