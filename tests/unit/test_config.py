"""Config loading: every rejection names the offending field path."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sidecar.commands.generate import template_text
from sidecar.config.schema import ConfigError, parse

BASE = """
backends:
  - name: a
    url: http://127.0.0.1:9000
    models: [m1, m2]
  - name: b
    url: https://api.example.com/v1
    models: [m3]
    api_key: ${KEY_B}
"""


def errors_of(text: str, env: dict | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse(text, env=env if env is not None else {"KEY_B": "x"})
    return info.value.errors


def test_template_is_valid():
    loaded = parse(template_text("ab-testing"), env={})
    assert loaded.config.model_experiments[0].model == "chat"
    assert loaded.warnings == []


def test_env_substitution_and_default():
    cfg = parse(BASE + "\nserver: {admin_token: '${TOKEN:-fallback}'}\n", env={"KEY_B": "sk-1"}).config
    assert cfg.backends[1].api_key == "sk-1"
    assert cfg.server.admin_token == "fallback"


def test_missing_env_names_path():
    assert errors_of(BASE, env={}) == ["backends[1].api_key: environment variable KEY_B is not set"]


@pytest.mark.parametrize(
    "extra, expected",
    [
        ("bogus: 1", "bogus: unknown field"),
        ("server: {max_body_bytes: 1}", "server.max_body_bytes: must be >= 1024"),
        ("server: {grpc_listen: nowhere}", "server.grpc_listen: must be host:port"),
        ("proxy: {variant_suffixes: {enabled: 3}}", "proxy.variant_suffixes.enabled: must be true or false"),
        (
            "model_experiments: [{name: e, model: chat, variants: [{id: a, model: m1, weight: 1}, {id: b, model: m2, weight: 1000001}]}]",
            "model_experiments[0].variants[1].weight: must be <= 1000000",
        ),
        (
            "model_experiments: [{name: 'bad name', model: chat, variants: [{id: a, model: m1, weight: 1}]}]",
            "model_experiments[0].name: must be 1 to 64 of A-Z a-z 0-9 . _ - (got 'bad name')",
        ),
        (
            "model_experiments: [{name: e, model: chat, sticky_key: cookie, variants: [{id: a, model: m1, weight: 1}]}]",
            "model_experiments[0].sticky_key: must be api_key, user, none or header:<name>",
        ),
        (
            "model_experiments: [{name: e, model: chat, sticky_ttl: 30s, variants: [{id: a, model: m1, weight: 1}]}]",
            "model_experiments[0].sticky_ttl: must be between 60s and 365d",
        ),
        (
            "model_experiments: [{name: e, model: chat, sticky_ttl: 1w, variants: [{id: a, model: m1, weight: 1}]}]",
            "model_experiments[0].sticky_ttl: must be a whole number with an optional s, m, h or d unit",
        ),
        (
            "model_experiments: [{name: e, model: chat, variants: [{id: a, model: m1, weight: 0}]}]",
            "model_experiments[0].variants: at least one variant needs a weight above 0",
        ),
        (
            "model_experiments: [{name: e, model: chat, variants: [{id: a, model: m1, weight: 1}, {id: a, model: m2, weight: 1}]}]",
            "model_experiments[0].variants[1].id: duplicate variant id 'a'",
        ),
        (
            "model_experiments: [{name: e, model: chat, variants: [{id: a, model: m1, weight: 1, backends: [nope]}]}]",
            "model_experiments[0].variants[0].backends[0]: unknown backend 'nope'",
        ),
        (
            "model_experiments: [{name: e, model: chat, variants: [{id: a, model: m1, weight: 1, backends: [b]}]}]",
            "model_experiments[0].variants[0].model: none of the pinned backends lists 'm1'",
        ),
        (
            "model_experiments: [{name: e, model: chat, hide_variant_models: true, variants: [{id: a, model: chat, weight: 1}]}]",
            "model_experiments[0].variants[0].model: a hidden experiment cannot use its own client model 'chat' as a variant",
        ),
        (
            "model_experiments: [{name: e, model: chat, variants: [{id: a, model: m1, weight: 1}]}, {name: e, model: chat2, variants: [{id: a, model: chat, weight: 1}]}]",
            "model_experiments[1].name: duplicate experiment name 'e'",
        ),
        (
            "model_experiments: [{name: e, model: chat, variants: [{id: a, model: m1, weight: 1}]}, {name: f, model: chat2, variants: [{id: a, model: chat, weight: 1}]}]",
            "model_experiments[1].variants[0].model: 'chat' is the client model of another experiment; experiments cannot chain",
        ),
        ("api_keys: [{key: k, id: x, allowed_backends: [zz]}]", "api_keys[0].allowed_backends[0]: unknown backend 'zz'"),
        ("api_keys: [{key: '  ', id: x}]", "api_keys[0].key: must not be blank"),
        ("monitor: {generation_check_timeout_s: 0}", "monitor.generation_check_timeout_s: must be >= 0.05"),
        ("monitor: {generation_check_timeout_s: 601}", "monitor.generation_check_timeout_s: must be <= 600.0"),
    ],
)
def test_rejections_name_the_field(extra, expected):
    assert expected in errors_of(BASE + extra + "\n")


def test_backend_rules():
    text = """
backends:
  - {name: model-router-sidecar, url: 'http://127.0.0.1:1'}
  - {name: ok, url: 'ftp://x'}
  - {name: 'bad/name', url: 'http://x'}
"""
    errs = errors_of(text)
    assert "backends[0].name: 'model-router-sidecar' is reserved for the sidecar's own cluster" in errs
    assert "backends[1].url: must be an http:// or https:// URL, or demo://" in errs
    assert "backends[2].name: must be 1 to 64 of A-Z a-z 0-9 . _ - (got 'bad/name')" in errs


def test_engine_types_probe_and_scrape_by_their_engine():
    cfg = parse("""
backends:
  - {name: v, url: 'http://127.0.0.1:1', type: vllm}
  - {name: s, url: 'http://127.0.0.1:2', type: sglang, health_path: /health_generate}
  - {name: t, url: 'http://127.0.0.1:3', type: tgi, metrics_path: ''}
  - {name: l, url: 'http://127.0.0.1:4', type: llamacpp}
  - {name: o, url: 'http://127.0.0.1:5', type: openai}
""", env={}).config
    v, s, t, lc, o = cfg.backends
    assert [(b.probe_path, b.scrape_path) for b in cfg.backends] == [
        ("/health", "/metrics"), ("/health_generate", "/metrics"), ("/health", None), ("/health", "/metrics"),
        (None, None),
    ]
    assert s.health_check.kind == "generation" and s.health_check.path == "/health_generate"
    assert lc.engine.name == "llamacpp" and lc.family == "openai" and o.engine is None and o.health_check is None
    assert errors_of("backends: [{name: x, url: 'http://x', type: ollama}]") == [
        "backends[0].type: must be one of 'openai', 'vllm', 'sglang', 'tgi', 'llamacpp' or 'anthropic'"
    ]


def test_duplicate_backend_and_control_characters():
    errs = errors_of("backends: [{name: a, url: 'http://x'}, {name: a, url: 'http://y', models: [\"bad\\x01\"]}]")
    assert any(e.startswith("backends[1].models") and "control characters" in e for e in errs)
    for bad in ("bad\\x85", "bad\\u2028", "bad\\u2029"):  # C1 and the Unicode line separators too
        errs = errors_of(f"backends: [{{name: a, url: 'http://x', models: [\"{bad}\"]}}]")
        assert any(e.startswith("backends[0].models") and "control characters" in e for e in errs), (bad, errs)
    errs = errors_of("backends: [{name: a, url: 'http://x'}, {name: a, url: 'http://y'}]")
    assert errs == ["backends[1].name: duplicate backend name 'a'"]


def test_a_model_name_no_request_could_name_is_refused():
    # The config holds model names to the rule request bodies are held to: a
    # name of spaces alone, or past 256 characters, could never be asked for.
    for bad, why in (("'   '", "must not be empty"), ("''", "must not be empty"), ("x" * 257, "is longer than 256")):
        errs = errors_of(f"backends: [{{name: a, url: 'http://x', models: [{bad}]}}]")
        assert any(e.startswith("backends[0].models[0]") and why in e for e in errs), (bad, errs)
    cfg = parse(f"backends: [{{name: a, url: 'http://x', models: [{'x' * 256}, ' spaced name ']}}]").config
    assert list(cfg.backends[0].models) == ["x" * 256, " spaced name "]


def test_type_errors_read_plainly():
    errs = errors_of(BASE + "model_experiments: [{name: e, model: chat, variants: [{id: a, model: m1, weight: lots}]}]\nbackends_x: 1\n")
    assert "model_experiments[0].variants[0].weight: must be a whole number" in errs
    assert "backends_x: unknown field" in errs
    assert errors_of("backends: {a: 1}") == ["backends: must be a list"]


def test_every_error_is_reported_at_once():
    errs = errors_of(BASE + "bogus: 1\nserver: {workers: 0, max_body_bytes: 5}\n")
    assert {"bogus: unknown field", "server.workers: must be >= 1", "server.max_body_bytes: must be >= 1024"} <= set(errs)


def test_warnings():
    loaded = parse(
        BASE
        + """
model_aliases: {fast: m2}
model_experiments:
  - {name: e, model: chat, sticky_key: none, sticky_ttl: 7d, hide_variant_models: true,
     variants: [{id: a, model: m1, weight: 1}, {id: b, model: m2, weight: 1}]}
  - {name: f, model: chat2, variants: [{id: a, model: m1, weight: 1}]}
""",
        env={"KEY_B": "x"},
    )
    w = loaded.warnings
    assert "model_experiments[0].sticky_ttl: has no effect with sticky_key: none" in w
    assert any(x.startswith("model_aliases.fast: points at 'm2'") for x in w)
    assert any(x.startswith("model_experiments[1].variants[0].model: 'm1' is reserved") for x in w)
    assert loaded.config.model_experiments[0].sticky_ttl == 7 * 86400


def test_not_yaml_and_not_mapping():
    assert errors_of("a: [")[0].startswith("(root): not valid YAML")
    assert errors_of("- 1\n") == ["(root): must be a mapping of sections"]


def test_config_is_immutable():
    cfg = parse(BASE, env={"KEY_B": "x"}).config
    with pytest.raises(ValidationError, match="frozen"):
        cfg.backends[0].name = "z"


def test_at_most_32_experiments_of_16_variants():
    variants = ", ".join(f"{{id: v{j}, model: m1, weight: 1}}" for j in range(17))
    errs = errors_of(BASE + f"model_experiments: [{{name: e, model: chat, variants: [{variants}]}}]\n")
    assert errs == ["model_experiments[0].variants: at most 16 entries"]
    exps = ", ".join(f"{{name: e{i}, model: c{i}, variants: [{{id: a, model: m1, weight: 1}}]}}" for i in range(33))
    assert errors_of(BASE + f"model_experiments: [{exps}]\n") == ["model_experiments: at most 32 entries"]
    exps = ", ".join(f"{{name: e{i}, model: c{i}, variants: [{{id: a, model: m1, weight: 1}}]}}" for i in range(32))
    assert len(parse(BASE + f"model_experiments: [{exps}]\n", env={"KEY_B": "x"}).config.model_experiments) == 32


# A YAML block scalar ("name: |") ends its value with a newline; every name the
# router later puts in a header, a metric label or an Envoy cluster name must
# reject it at load, not fail each request at run time.
_EXP = "model_experiments: [{name: %s, model: chat, variants: [{id: %s, model: m1, weight: 1}]}]"


@pytest.mark.parametrize(
    "snippet, path",
    [
        (_EXP % ('"e1\\n"', "v1"), "model_experiments[0].name"),
        (_EXP % ("e1", '"v1\\n"'), "model_experiments[0].variants[0].id"),
        ('model_experiments: [{name: e1, model: "chat\\n", variants: [{id: v1, model: m1, weight: 1}]}]',
         "model_experiments[0].model"),
        ('model_experiments: [{name: e1, model: chat, variants: [{id: v1, model: m1, weight: 1, backends: ["a\\n"]}]}]',
         "model_experiments[0].variants[0].backends[0]"),
        ('api_keys: [{key: k1, id: "team-a\\n"}]', "api_keys[0].id"),
        ('api_keys: [{key: "k1\\n", id: team-a}]', "api_keys[0].key"),
        ('api_keys: [{key: k1, id: team-a, allowed_models: ["m1\\n"]}]', "api_keys[0].allowed_models[0]"),
        ('api_keys: [{key: k1, id: team-a, allowed_backends: ["a\\n"]}]', "api_keys[0].allowed_backends[0]"),
        ('model_aliases: {"fast\\n": m1}', "model_aliases['fast\\n'] (the key)"),
        ('model_aliases: {fast: "m1\\n"}', "model_aliases.fast"),
        ('model_metadata: [{id: "m1\\n"}]', "model_metadata[0].id"),
    ],
)
def test_names_with_a_trailing_newline_are_rejected(snippet, path):
    errs = errors_of(BASE + snippet)
    assert any(e.startswith(path + ":") for e in errs), errs


def test_backend_name_with_a_trailing_newline_is_rejected():
    errs = errors_of('backends: [{name: "a\\n", url: "http://127.0.0.1:1"}]')
    assert errs == ["backends[0].name: must be 1 to 64 of A-Z a-z 0-9 . _ - (got 'a\\n')"]


def test_config_validate_command_refuses_a_block_scalar_name(tmp_path, capsys):
    from sidecar.commands.main import main

    path = tmp_path / "router.yaml"
    path.write_text(BASE.replace("KEY_B", "HOME") + "model_experiments:\n  - name: |\n      e1\n    model: chat\n"
                    "    variants: [{id: v1, model: m1, weight: 1}]\n")
    assert main(["config", "validate", str(path)]) == 1
    assert "model_experiments[0].name" in capsys.readouterr().err
