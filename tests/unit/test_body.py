"""Request body parsing and in-place rewriting."""

from __future__ import annotations

import json
import re

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.payload.body import BodyError, parse_json, set_top_level, top_level_spans
from tests.support.properties import budget

text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=False, allow_infinity=False), text,
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)), max_leaves=20)
objects = st.dictionaries(text, values, max_size=6)


def encodings(obj):
    """The same object written with different spacing and escaping."""
    yield json.dumps(obj).encode()
    yield json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    yield json.dumps(obj, ensure_ascii=False, indent=2).encode()


@settings(max_examples=budget(300), deadline=None)
@given(objects, text, st.booleans(), text)
def test_set_top_level_changes_only_the_named_keys(obj, model, present, original):
    if present:
        obj = dict(obj, model=original)
    else:
        obj.pop("model", None)
    for raw in encodings(obj):
        out = set_top_level(raw, {"model": model})
        assert json.loads(out) == dict(obj, model=model)
        # With the parsed object at hand the top-level shortcut may apply: same bytes.
        assert set_top_level(raw, {"model": model}, obj) == out
        if present and raw.count(b'"model"') == 1 and not re.search(rb"\\u00[3-7]", raw):
            # Where native searches place the edit, every byte outside the value is the client's own.
            (s, e), = top_level_spans(raw, {"model"})["model"]
            assert out[:s] == raw[:s] and out[len(out) - (len(raw) - e):] == raw[e:]


def test_big_numbers_survive_an_edit_in_place():
    raw = b'{"model": "a", "seed": 123456789012345678901234567890, "x": {"mode": "inner"}}'
    out = set_top_level(raw, {"model": "z", "stream_options": {"include_usage": True}}, {"model": "a"})
    assert out == (b'{"stream_options":{"include_usage":true},"model": "z", "seed": 123456789012345678901234567890, '
                   b'"x": {"mode": "inner"}}')


def test_duplicate_and_escaped_keys_are_encoded_again_as_the_engine_reads_them():
    """No scan over every member: a key that native searches cannot place
    (spelled twice, or with escapes) makes the body the parsed object again,
    its last duplicate winning as in the engine's parser."""
    for raw in (b'{"model": "a", "x": {"model": "inner"}, "model":"b"}',
                b'{"m\\u006fdel": "a", "x": {"model": "inner"}}'):
        parsed = json.loads(raw)
        out = set_top_level(raw, {"model": "z"}, parsed)
        assert json.loads(out) == {**parsed, "model": "z"}
        assert out.count(b'"model":"z"') == 1


def test_a_value_spelled_otherwise_than_its_canonical_encoding_is_found_where_it_is():
    """The usual edit looks for the old value's canonical encoding right after
    the key's ':'. Written otherwise (an escaped '/', an escaped letter past
    ASCII), that encoding can stand elsewhere in the body, as another value;
    the edit must still land on the model's own value."""
    for raw in (b'{"model" : "a\\/b", "other": "a/b"}', b'{"model":"caf\\u00e9","other":"caf\xc3\xa9"}'):
        parsed = orjson.loads(raw)
        out = set_top_level(raw, {"model": "z"}, parsed)
        assert orjson.loads(out) == {**parsed, "model": "z"}
        assert out.endswith(raw[raw.index(b","):]), out  # the other member, byte for byte


def test_insert_into_empty_object():
    assert json.loads(set_top_level(b" { } ", {"model": "m"})) == {"model": "m"}


def test_escaped_quotes_and_backslashes_in_strings():
    raw = json.dumps({"a": 'he said \\"hi\\" \\\\', "model": "m", "b": ["]", "}", "\\\\"]}).encode()
    assert json.loads(set_top_level(raw, {"model": "n"}))["model"] == "n"


@pytest.mark.parametrize("raw", [b"", b"   ", b"[]", b"nul", b'{"model": "\\ud800"}', b"{'model': 1}"])
def test_unusable_bodies_raise(raw):
    with pytest.raises(BodyError):
        parse_json(raw)


def test_parse_keeps_large_integers_parseable():
    assert parse_json(b'{"model": "m", "n": 123456789012345678901234567890}')["model"] == "m"


def test_rewrite_of_20_mib_body_is_one_pass():
    raw = orjson.dumps({"messages": [{"role": "user", "content": "x" * (20 * 1024 * 1024)}], "model": "chat"})
    out = set_top_level(raw, {"model": "m"})
    assert len(out) == len(raw) - 3 and out.endswith(b'"model":"m"}')


def test_escaped_top_level_key_is_found_not_a_nested_lookalike():
    raw = b'{"mod\\u0065l": "chat", "x": {"model": "chat"}}'
    out = set_top_level(raw, {"model": "m"})
    assert json.loads(out) == {"model": "m", "x": {"model": "chat"}}
    raw = b'{"x": "model", "model": "chat"}'
    assert json.loads(set_top_level(raw, {"model": "m"})) == {"x": "model", "model": "m"}


def test_a_short_old_value_is_replaced_in_place_and_a_long_one_by_encoding_again():
    for n, in_place in ((682, True), (683, False)):  # each \x01 encodes as \u0001: 6 bytes, 2 more for the quotes
        old = "\x01" * n
        raw = b'{ "model" : ' + orjson.dumps(old) + b', "x": [1,  2]}'
        got = set_top_level(raw, {"model": "m"}, orjson.loads(raw))
        if in_place:
            assert got == b'{ "model" : "m", "x": [1,  2]}'
        else:
            assert got == orjson.dumps({"model": "m", "x": [1, 2]})
    raw = b'{"x": 1,  "model": "a", "stream_options": null}'
    got = set_top_level(raw, {"model": "b", "stream_options": {"include_usage": True}}, orjson.loads(raw))
    assert got == b'{"x": 1,  "model": "b", "stream_options": {"include_usage":true}}'
