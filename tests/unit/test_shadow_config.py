"""Shadow arms in the config: how they are written, what is refused, what they reserve."""

from __future__ import annotations

import orjson
import pytest

from sidecar.config.schema import ConfigError, parse
from sidecar.routing import Caller, Request, decide, shadow, snapshot
from sidecar.routing.ingress import lookup
from sidecar.routing.reservation import reserved_by
from sidecar.routing.trace import Trace

BACKENDS = """
backends:
  - {name: a, url: "http://127.0.0.1:9000", models: [m1]}
  - {name: b, url: "http://127.0.0.1:9001", models: [m2]}
  - {name: c, url: "http://127.0.0.1:9002", models: [m2, m3]}
  - {name: hidden, url: "http://127.0.0.1:9003", models: [m3], internal: true}
"""


def config_with(*arms: str, hide: bool = False) -> str:
    variants = ", ".join(["{id: control, model: m1, weight: 1}", *arms])
    return BACKENDS + f"model_experiments: [{{name: e, model: chat, hide_variant_models: {str(hide).lower()}, variants: [{variants}]}}]\n"


def errors_of(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse(text, env={})
    return info.value.errors


def test_a_shadow_is_kept_apart_from_the_arms_that_serve_callers():
    e = parse(config_with("{id: cand, model: m2, shadow: {share: 0.25, max_in_flight: 4}}"), env={}).config.model_experiments[0]
    assert [v.id for v in e.variants] == ["control"]  # what assignment races
    (arm,) = e.shadows
    assert (arm.id, arm.model, arm.shadow.share, arm.shadow.max_in_flight) == ("cand", "m2", 0.25, 4)


def test_a_shadow_goes_to_its_pin_or_the_first_backend_listing_its_model():
    cfg = parse(config_with("{id: cand, model: m2, shadow: {share: 0.5}}"), env={}).config
    assert [(t.experiment, t.backend, t.cluster) for t in shadow.targets(cfg)] == [("e", "b", "shadow~e")]
    cfg = parse(config_with("{id: cand, model: m2, backends: [c], shadow: {share: 0.5}}"), env={}).config
    assert [t.backend for t in shadow.targets(cfg)] == ["c"]


@pytest.mark.parametrize(("arm", "message"), [
    ("{id: cand, model: m2, weight: 1, shadow: {share: 0.1}}", "a shadow arm has no weight"),
    ("{id: cand, model: m2, shadow: {share: 0}}", "shadow.share: must be > 0"),
    ("{id: cand, model: m2, shadow: {share: 1.5}}", "shadow.share: must be <= 1"),
    ("{id: cand, model: m2, shadow: {}}", "variants[1].shadow.share: required"),
    ("{id: cand, model: m2, shadow: {share: 0.1, max_in_flight: 0}}", "shadow.max_in_flight: must be >= 1"),
    ("{id: cand, model: m2, shadow: {share: 0.1, mirror: true}}", "mirror: unknown field"),
    ("{id: control, model: m2, shadow: {share: 0.1}}", "duplicate variant id 'control'"),
    ("{id: cand, model: m9, shadow: {share: 0.1}}", "no backend lists 'm9'; pin the backend"),
    ("{id: cand, model: m3, backends: [hidden], shadow: {share: 0.1}}", "backend 'hidden' is internal"),
    ("{id: cand, model: m2, backends: [a], shadow: {share: 0.1}}", "the pinned backend 'a' does not list 'm2'"),
    ("{id: cand, model: m2, backends: [b, c], shadow: {share: 0.1}}", "pin exactly one"),
    ("{id: cand, model: m2, backends: [zz], shadow: {share: 0.1}}", "unknown backend 'zz'"),
])
def test_a_bad_shadow_arm_is_refused_by_name(arm, message):
    errs = errors_of(config_with(arm))
    assert any(message in e and e.startswith("model_experiments[0]") for e in errs), errs


def test_at_most_one_shadow_per_experiment():
    errs = errors_of(config_with("{id: s1, model: m2, shadow: {share: 0.1}}", "{id: s2, model: m2, shadow: {share: 0.1}}"))
    assert any("at most one shadow arm per experiment ('s2' is a second)" in e for e in errs), errs


def test_shadows_is_not_a_key_of_its_own():
    text = BACKENDS + "model_experiments: [{name: e, model: chat, variants: [{id: c, model: m1, weight: 1}], shadows: []}]\n"
    assert any("unknown field 'shadows'" in e for e in errors_of(text))


def test_a_shadow_alone_serves_nobody():
    text = BACKENDS + "model_experiments: [{name: e, model: chat, variants: [{id: s, model: m2, shadow: {share: 0.1}}]}]\n"
    assert any("at least one variant is required" in e for e in errors_of(text))


def test_a_hidden_experiment_reserves_its_shadow_model():
    cfg = parse(config_with("{id: cand, model: m2, shadow: {share: 0.1}}", hide=True), env={}).config
    snap = snapshot.build(cfg)
    assert reserved_by(snap, "m2") == "e"
    cfg = parse(config_with("{id: cand, model: m2, shadow: {share: 0.1}}"), env={}).config
    assert reserved_by(snapshot.build(cfg), "m2") is None


def test_the_draw_copies_below_the_share_only():
    e = parse(config_with("{id: cand, model: m2, shadow: {share: 0.25}}"), env={}).config.model_experiments[0]
    assert shadow.draw(e, 0.0) == "shadow~e"
    assert shadow.draw(e, 0.2499) == "shadow~e"
    assert shadow.draw(e, 0.25) is None
    plain = parse(config_with(), env={}).config.model_experiments[0]
    assert shadow.draw(plain, 0.0) is None and shadow.draw(None, 0.0) is None


def test_a_shadow_backend_under_another_base_path_is_refused():
    text = BACKENDS.replace('url: "http://127.0.0.1:9001"', 'url: "http://127.0.0.1:9001/openai"')
    errs = errors_of(text + "model_experiments: [{name: e, model: chat, variants: [{id: control, model: m1, weight: 1}, "
                     "{id: cand, model: m2, backends: [b], shadow: {share: 0.1}}]}]\n")
    assert any("backend 'b' has the base path '/openai' but the live arms' backend 'a' has ''" in e for e in errs), errs


def _decided(snap: snapshot.Snapshot, model: str, u: float, trace: Trace | None = None):
    path = "/v1/chat/completions"
    return decide(snap, Request(ingress=lookup(path), path=path, headers={}, caller=Caller("k", None), rand=0.5,
                                body=orjson.dumps({"model": model, "messages": []}), shadow_rand=u, trace=trace))


def test_the_decision_names_the_copy_below_the_share_and_explain_shows_the_draw():
    snap = snapshot.build(parse(config_with("{id: cand, model: m2, shadow: {share: 0.25}}"), env={}).config)
    copied, kept = Trace(), Trace()
    assert _decided(snap, "chat", 0.1, copied).shadow == ("shadow~e", "cand")
    assert _decided(snap, "chat", 0.25, kept).shadow is None
    assert [(s["verdict"], s["copied"]) for s in copied.stages if s["stage"] == "shadow"] == [
        ("copied to the shadow arm 'cand' (m2)", True)]
    assert [s["copied"] for s in kept.stages if s["stage"] == "shadow"] == [False]
    # The arms that serve callers are untouched by the draw; a request outside
    # the experiment is never copied.
    assert _decided(snap, "chat", 0.1).upstream_model == _decided(snap, "chat", 0.9).upstream_model == "m1"
    assert _decided(snap, "m1", 0.0).shadow is None


def test_a_request_without_a_json_body_is_never_copied():
    # The copy's model is written into a JSON body; a multipart upload stays uncopied.
    snap = snapshot.build(parse(config_with("{id: cand, model: m2, shadow: {share: 1.0}}"), env={}).config)
    path, trace = "/v1/images/edits", Trace()
    body = b'--B\r\ncontent-disposition: form-data; name="model"\r\n\r\nchat\r\n--B--\r\n'
    r = decide(snap, Request(ingress=lookup(path), path=path, headers={"content-type": "multipart/form-data; boundary=B"},
                             caller=Caller("k", None), body=body, shadow_rand=0.0, trace=trace))
    assert r.upstream_model == "m1" and r.shadow is None
    assert [s["copied"] for s in trace.stages if s["stage"] == "shadow"] == [False]
