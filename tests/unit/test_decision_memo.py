"""The decision's per-snapshot tables: a verdict read from one is the verdict
the stages give, for every value it depends on, and a new config starts afresh."""

from __future__ import annotations

import importlib

import orjson
import pytest

from sidecar.config.schema import ApiKey, parse
from sidecar.errors import Reply
from sidecar.routing import Caller, Request, decide, snapshot
from sidecar.routing.ingress import lookup
from sidecar.routing.memo import PerSnapshot

CONFIG = """
backends:
  - {name: a, url: "http://127.0.0.1:1", models: [m-a, shared]}
  - {name: b, url: "http://127.0.0.1:2", models: [m-b, shared]}
model_aliases: {old: %s}
model_experiments:
  - name: exp
    model: chat
    variants:
      - {id: control, model: shared, weight: 1}
      - {id: pinned, model: shared, weight: 0, backends: [b]}
"""


def _snap(alias: str = "m-a"):
    return snapshot.build(parse(CONFIG % alias, env={}).config)


def _decide(snap, model: str, key: ApiKey | None = None, path: str = "/v1/chat/completions"):
    body = orjson.dumps({"model": model, "messages": []})
    return decide(snap, Request(ingress=lookup(path), path=path, headers={}, body=body,
                                caller=Caller("k" if key else None, key)))


def _key(**kw) -> ApiKey:
    return ApiKey(key="k", id="same-id", **kw)


def test_two_keys_with_different_allowed_models_get_each_their_own_gate():
    snap = _snap()
    assert not isinstance(_decide(snap, "m-a", _key(allowed_models=["m-a"])), Reply)
    refused = _decide(snap, "m-a", _key(allowed_models=["m-b"]))
    assert isinstance(refused, Reply) and refused.status == 403
    assert not isinstance(_decide(snap, "m-a", _key(allowed_models=["m-a"])), Reply)


def test_two_keys_with_different_allowed_backends_get_each_their_own_backends():
    snap = _snap()
    for backend in ("a", "b", "a"):
        r = _decide(snap, "shared", _key(allowed_backends=[backend]))
        assert not isinstance(r, Reply) and r.backend.name == backend
    r = _decide(snap, "shared", None)
    assert not isinstance(r, Reply) and r.backend.name == "a"


def test_two_models_and_two_ingress_readings_of_one_name():
    snap = _snap()
    a, b = _decide(snap, "m-a"), _decide(snap, "m-b")
    assert not isinstance(a, Reply) and not isinstance(b, Reply)
    assert (a.backend.name, b.backend.name) == ("a", "b")
    # /v1/responses honours model_aliases; /v1/chat/completions does not (the name goes on as sent).
    aliased = _decide(snap, "old", path="/v1/responses")
    assert not isinstance(aliased, Reply) and aliased.upstream_model == "m-a"
    for path in ("/v1/chat/completions", "/v1/embeddings"):  # /v1/embeddings differs only in that
        literal = _decide(snap, "old", path=path)
        assert isinstance(literal, Reply) and literal.status == 404


def test_a_pinned_arm_inside_a_key_s_allow_list():
    snap = _snap()
    info = snap.experiments["chat"]
    decide_module = importlib.import_module("sidecar.routing.decide")
    assert decide_module._pinned(snap, info, 1, None) == frozenset({"b"})
    assert decide_module._pinned(snap, info, 1, frozenset({"a"})) == frozenset()
    assert decide_module._pinned(snap, info, 1, frozenset({"a", "b"})) == frozenset({"b"})


def test_a_new_config_never_sees_the_old_one_s_entries():
    old, new = _snap("m-a"), _snap("m-b")
    r = _decide(old, "old", path="/v1/responses")
    assert not isinstance(r, Reply) and r.upstream_model == "m-a"
    r = _decide(new, "old", path="/v1/responses")
    assert not isinstance(r, Reply) and r.upstream_model == "m-b"


def test_a_table_is_bounded_and_per_snapshot():
    table: PerSnapshot[int] = PerSnapshot(limit=3)
    a, b = _snap(), _snap()
    calls = []

    def get(snap: snapshot.Snapshot, key: int, value: int) -> int:
        found = table.find(snap, key)
        if found is None:
            calls.append(value)
            found = table.keep(key, value)
        return found

    for n in range(10):
        assert get(a, n, n) == n
        assert len(table) <= 3
    assert get(a, 9, -1) == 9  # kept
    assert get(b, 9, 99) == 99  # another snapshot: computed again
    assert calls[-1] == 99


@pytest.mark.parametrize("model", ["m-a", "m-b", "shared", "chat", "old", "nope", "m-a:nitro"])
def test_a_decision_read_from_the_tables_matches_one_that_computes(model):
    """The same request twice (the second from the tables) and once on a fresh snapshot."""
    snap = _snap()
    first, second, fresh = _decide(snap, model), _decide(snap, model), _decide(_snap(), model)
    for r in (second, fresh):
        assert type(r) is type(first)
        if isinstance(first, Reply):
            assert (r.status, r.body) == (first.status, first.body)
        else:
            assert r.metadata() == first.metadata() and (r.body, r.path) == (first.body, first.path)
