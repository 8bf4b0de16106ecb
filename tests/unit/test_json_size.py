"""The body-size scan reads a JSON text's strings as a parser does, so its
counts of members and values are what parsing the text would build."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.payload import json_budget
from sidecar.payload.json_budget import Size, measure, upper_bound
from tests.support.properties import budget

# Text that tries to confuse a scanner: quotes, runs of backslashes, and every
# structural byte, inside keys and values.
TRICKY = st.text(alphabet=st.sampled_from(['"', "\\", ":", ",", "[", "]", "{", "}", "a", " ", "é", "\n", "\u2028"]),
                 max_size=8)
SCALARS = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False) | TRICKY
DOCS = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(TRICKY, inner, max_size=5),
                    max_leaves=40)


def reference(doc: Any) -> Size:
    """Members and values counted on the parsed tree (an empty container twice)."""
    members, values = 0, 1
    stack = [doc]
    while stack:
        node = stack.pop()
        children = list(node.values()) if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        members += len(node) if isinstance(node, dict) else 0
        values += len(children) if children else 1
        stack.extend(children)
    return Size(members, values)


def spellings(doc: Any) -> list[bytes]:
    return [orjson.dumps(doc), json.dumps(doc).encode(), json.dumps(doc, ensure_ascii=False).encode(),
            json.dumps(doc, indent=2).encode()]


@settings(max_examples=budget(2000), deadline=None)
@given(DOCS)
def test_the_scan_counts_what_the_parser_builds(doc):
    for text in spellings(doc):
        assert measure(text) == reference(orjson.loads(text)), text
        bound = upper_bound(text)
        assert bound.members >= measure(text).members and bound.values >= measure(text).values


@settings(max_examples=budget(300), deadline=None)
@given(DOCS, st.integers(1, 9))
def test_a_string_across_scan_chunks_is_still_one_string(doc, chunk):
    text = json.dumps({"k": doc, "s": 'a"b\\"c\\\\'}).encode()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(json_budget, "_SCAN_CHUNK", chunk)
        assert measure(text) == reference(orjson.loads(text))


def test_structure_inside_strings_is_text():
    assert measure(b'{"a\\\\":"x\\":,[{","b":["\\\\\\"]"]}') == Size(2, 4)
    assert measure(b'{"model":"m","x":"' + b'{\\"a\\":1,' * 1000 + b'"}') == Size(2, 3)


def test_empty_containers_are_counted_so_their_arrays_are_bounded():
    # Three million empty arrays are one member but take the parser about a second.
    assert measure(b'{"x":[' + b",".join([b"[]"] * 1000) + b"]}") == Size(1, 1 + 1 + 1 + 999 + 1000)
