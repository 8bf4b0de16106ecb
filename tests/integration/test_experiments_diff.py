"""Reassignment preview: exact expected movers (sidecar/experiments/reassignment.py) against the
published hash over real keys, and ``model-router experiments diff``."""

from __future__ import annotations

import json
import math
import textwrap
from fractions import Fraction
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.commands.main import main
from sidecar.config.schema import parse
from sidecar.experiments import reassignment
from sidecar.experiments.diff import KeyList, SeenKeys, diff
from sidecar.routing.assignment import _window, assign

N_KEYS = 10_000
KEYS = tuple(f"user-{i:05d}" for i in range(N_KEYS))
NOW = 1767225600  # 2026-01-01T00:00:00Z

BACKENDS = """
backends:
  - {name: pool, url: "http://127.0.0.1:1", models: [m-a, m-b, m-c, m-d]}
"""


def config(experiments: str, api_keys: str = ""):
    return parse(BACKENDS + api_keys + "model_experiments:\n" + textwrap.indent(textwrap.dedent(experiments), "  "),
                 env={}).config


def experiment(name: str, variants: list[tuple[str, int]], extra: str = "") -> str:
    lines = [f"- name: {name}", "  model: chat", *(f"  {x}" for x in extra.splitlines() if x), "  variants:"]
    models = iter(["m-a", "m-b", "m-c", "m-d"])
    lines += [f"    - {{id: {vid}, model: {next(models)}, weight: {w}}}" for vid, w in variants]
    return "\n".join(lines) + "\n"


def sigma_bound(p: float, n: int) -> float:
    """4.5 binomial standard deviations of a count with probability p over n trials."""
    return 4.5 * math.sqrt(n * p * (1 - p))


def recomputed_movers(old_name, old_variants, new_name, new_variants, keys, ttl=(None, None), at=NOW):
    """Every key's arm under both, with the public assign() (not the diff's code path)."""
    out = []
    for k in keys:
        a = assign(old_name, old_variants, k, ttl_seconds=ttl[0], unix_time=at).variant_id
        b = assign(new_name, new_variants, k, ttl_seconds=ttl[1], unix_time=at).variant_id
        if a != b:
            out.append((k, a, b))
    return out


EDITS = {
    "weight edit": ([("a", 50), ("b", 30), ("c", 20)], [("a", 50), ("b", 30), ("c", 40)]),
    "added arm": ([("a", 60), ("b", 40)], [("a", 60), ("b", 40), ("c", 25)]),
    "zeroed arm": ([("a", 50), ("b", 30), ("c", 20)], [("a", 50), ("b", 0), ("c", 20)]),
    "several weights at once": ([("a", 50), ("b", 30), ("c", 20)], [("a", 20), ("b", 30), ("c", 50)]),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_predicted_movers_equal_actual_movers_over_10000_keys(edit):
    old_v, new_v = EDITS[edit]
    d = diff(config(experiment("exp", old_v)), config(experiment("exp", new_v)), NOW, KeyList(KEYS))
    (e,) = d.experiments
    assert e.status == "changed" and not e.reshuffle and e.kept_key_share == 1
    # Per key: the diff's movers are exactly the keys whose arm the published hash changes.
    expected_list = recomputed_movers("exp", old_v, "exp", new_v, KEYS)
    assert list(e.observed.movers) == expected_list
    # Per cell: each predicted share against the observed count, within 4.5 binomial sigmas.
    observed = {}
    for _, f, t in expected_list:
        observed[(f, t)] = observed.get((f, t), 0) + 1
    for cell in set(observed) | {c for c in e.expected if c[0] != c[1]}:
        p = float(e.expected.get(cell, 0))
        assert abs(observed.get(cell, 0) - N_KEYS * p) <= max(sigma_bound(p, N_KEYS), 1e-9), (cell, p, observed)
    p = float(e.moving_share)
    assert abs(len(expected_list) - N_KEYS * p) <= sigma_bound(p, N_KEYS)


def test_single_edits_move_the_minimum_and_several_at_once_move_more():
    for edit in ("weight edit", "added arm", "zeroed arm"):
        old_v, new_v = EDITS[edit]
        (e,) = diff(config(experiment("exp", old_v)), config(experiment("exp", new_v)), NOW).experiments
        assert e.moving_share == e.minimum_share, edit
    (e,) = diff(config(experiment("exp", EDITS["several weights at once"][0])),
                config(experiment("exp", EDITS["several weights at once"][1])), NOW, KeyList(KEYS)).experiments
    assert e.minimum_share == Fraction(3, 10) and e.moving_share == Fraction(24, 65)  # 36.9%
    # The sample tells the two apart: the minimum (total variation) is not what the hash does.
    movers = len(e.observed.movers)
    assert abs(movers - N_KEYS * 0.3) > sigma_bound(0.3, N_KEYS)


def test_zeroed_arm_callers_spread_by_weight_and_nobody_else_moves():
    old_v, new_v = EDITS["zeroed arm"]
    (e,) = diff(config(experiment("exp", old_v)), config(experiment("exp", new_v)), NOW).experiments
    assert {c: s for c, s in e.expected.items() if c[0] != c[1]} == {
        ("b", "a"): Fraction(3, 10) * Fraction(50, 70), ("b", "c"): Fraction(3, 10) * Fraction(20, 70),
    }
    assert any("paused" in n for n in e.notes)


def test_rename_is_a_full_reshuffle():
    variants = [("control", 90), ("candidate", 10)]
    d = diff(config(experiment("split", variants)), config(experiment("split-v2", variants)), NOW, KeyList(KEYS))
    (e,) = d.experiments
    assert e.status == "renamed" and e.reshuffle and e.kept_key_share == 0
    assert e.moving_share == 1 - Fraction(9, 10) ** 2 - Fraction(1, 10) ** 2  # 18%, where a weights-only view says 0
    assert any("renamed from 'split' to 'split-v2'" in n and "drawn afresh" in n for n in e.notes)
    assert list(e.observed.movers) == recomputed_movers("split", variants, "split-v2", variants, KEYS)
    assert abs(len(e.observed.movers) - N_KEYS * 0.18) <= sigma_bound(0.18, N_KEYS)
    assert d.to_dict()["experiments"][0]["reshuffle"] is True


def test_sticky_key_and_ttl_changes_are_reshuffles():
    v = [("a", 50), ("b", 50)]
    (e,) = diff(config(experiment("exp", v)), config(experiment("exp", v, "sticky_key: user")), NOW,
                KeyList(KEYS)).experiments
    assert e.reshuffle and e.observed is None and "sticky_key" in e.observed_note
    assert any("sticky_key changes from api_key to user" in n for n in e.notes)
    (e,) = diff(config(experiment("exp", v, "sticky_ttl: 7d")), config(experiment("exp", v, "sticky_ttl: 30d")),
                NOW, KeyList(KEYS)).experiments
    assert e.reshuffle and e.moving_share == Fraction(1, 2)
    assert any("sticky_ttl changes from 7d to 30d" in n for n in e.notes)
    assert list(e.observed.movers) == recomputed_movers("exp", v, "exp", v, KEYS, ttl=(604800, 2592000))
    (e,) = diff(config(experiment("exp", v)), config(experiment("exp", v, "sticky_ttl: 7d")), NOW).experiments
    assert e.reshuffle


def test_ttl_edit_of_long_windows_keeps_some_keys_and_the_count_is_exact():
    """364d -> 365d: many callers keep their window number, hence their draw."""
    v = [("a", 50), ("b", 50)]
    (e,) = diff(config(experiment("exp", v, "sticky_ttl: 364d")), config(experiment("exp", v, "sticky_ttl: 365d")),
                NOW, KeyList(KEYS)).experiments
    kept = e.kept_key_share
    assert 0 < kept < 1 and not e.reshuffle
    assert e.moving_share == (1 - kept) * Fraction(1, 2)
    movers = recomputed_movers("exp", v, "exp", v, KEYS, ttl=(364 * 86400, 365 * 86400))
    assert list(e.observed.movers) == movers
    p = float(e.moving_share)
    assert abs(len(movers) - N_KEYS * p) <= sigma_bound(p, N_KEYS)


@pytest.mark.parametrize("t1, t2", [(60, 90), (60, 61), (84, 126), (100, 150), (120, 120), (97, 60)])
@pytest.mark.parametrize("at", [0, 59, 149, 5000, 3599, 1767225600])
def test_kept_key_share_counts_every_offset(t1, t2, at):
    """Over one full period of offsets, the share of keys whose window number survives."""
    period = t1 * t2 // math.gcd(t1, t2)
    same = sum(_window(x.to_bytes(8, "big"), t1, at)[1] == _window(x.to_bytes(8, "big"), t2, at)[1]
               for x in range(period))
    assert reassignment.kept_key_share(t1, t2, at) == Fraction(same, period)


weights = st.lists(st.integers(0, 1000), min_size=1, max_size=6)


@given(weights, weights, st.booleans())
def test_joint_shares_add_up_to_both_sides_exactly(old_w, new_w, fresh):
    old = [(f"v{i}", w) for i, w in enumerate(old_w)]
    new = [(f"v{i}", w) for i, w in enumerate(new_w)] + [("extra", 7)]
    if not any(w for _, w in old):
        old.append(("only-old", 1))
    joint = (reassignment.independent if fresh else reassignment.same_key)(old, new)
    p, q = reassignment.shares(old), reassignment.shares(new)
    assert all(s > 0 for s in joint.values())
    for i, pi in p.items():
        assert sum(s for (f, _), s in joint.items() if f == i) == pi
    for j, qj in q.items():
        assert sum(s for (_, t), s in joint.items() if t == j) == qj


def test_the_90_10_to_80_20_example_of_the_docs():
    joint = reassignment.same_key([("control", 90), ("candidate", 10)], [("control", 80), ("candidate", 20)])
    assert joint == {("control", "control"): Fraction(4, 5), ("control", "candidate"): Fraction(1, 10),
                     ("candidate", "candidate"): Fraction(1, 10)}


def test_a_new_variant_id_is_a_new_arm_not_a_relabel():
    old = config(experiment("exp", [("a", 50), ("b", 50)]))
    new = config(experiment("exp", [("a", 50), ("b2", 50)]).replace("m-c", "m-b"))
    (e,) = diff(old, new, NOW).experiments
    assert any("'b' is gone and 'b2' serves the same model 'm-b'" in n for n in e.notes)
    assert e.moving_share == Fraction(2, 3)  # only a -> a (1/3) stays; b's callers now hold another id


def test_added_and_removed_experiments():
    old = config(experiment("exp", [("a", 1)]))
    new = parse(BACKENDS + "model_experiments:\n" + textwrap.indent(
        experiment("other", [("a", 1)]).replace("model: chat", "model: chat-2"), "  "), env={}).config
    statuses = {e.name: e.status for e in diff(old, new, NOW).experiments}
    assert statuses == {"exp": "removed", "other": "added"}


def test_usage_records_name_key_ids_never_keys():
    keys = "api_keys:\n" + "".join(f"  - {{key: sk-{i:04d}, id: team-{i}}}\n" for i in range(200))
    v_old, v_new = [("a", 80), ("b", 20)], [("a", 50), ("b", 50)]
    old, new = config(experiment("exp", v_old), keys), config(experiment("exp", v_new), keys)
    seen = SeenKeys({"exp": tuple(f"team-{i}" for i in range(200))}, {k.id: k.key for k in old.api_keys})
    (e,) = diff(old, new, NOW, seen).experiments
    want = [(f"team-{i}", f, t) for i in range(200)
            for _, f, t in recomputed_movers("exp", v_old, "exp", v_new, [f"sk-{i:04d}"])]
    assert list(e.observed.movers) == want and want
    assert "sk-" not in json.dumps(e.to_dict())


# --------------------------------------------------------------------------- the command


@pytest.fixture
def files(tmp_path):
    def write(name, text):
        p = tmp_path / name
        p.write_text(text, encoding="utf-8")
        return str(p)

    old = write("old.yaml", BACKENDS + "model_experiments:\n" + textwrap.indent(
        experiment("split", [("control", 90), ("candidate", 10)]), "  "))
    new = write("new.yaml", BACKENDS + "model_experiments:\n" + textwrap.indent(
        experiment("split", [("control", 80), ("candidate", 20)]), "  "))
    renamed = write("renamed.yaml", BACKENDS + "model_experiments:\n" + textwrap.indent(
        experiment("split-v2", [("control", 90), ("candidate", 10)]), "  "))
    keys = write("keys.txt", "\n".join(KEYS[:2000]) + "\n\n")
    return {"old": old, "new": new, "renamed": renamed, "keys": keys, "write": write}


def test_command_prints_a_table(files, capsys):
    assert main(["experiments", "diff", files["old"], files["new"], "--keys", files["keys"], "--movers", "2"]) == 0
    out = capsys.readouterr().out
    assert "experiment split (client model 'chat', sticky_key api_key): changed" in out
    assert "expected: 10.00% of sticky callers change arm" in out
    assert "    control  ->  candidate  10.00%\n" in out
    movers = recomputed_movers("split", [("control", 90), ("candidate", 10)], "split",
                               [("control", 80), ("candidate", 20)], KEYS[:2000])
    assert f"observed: {len(movers)} of 2000 callers change arm" in out
    assert f"movers: the first 2; {len(movers) - 2} more with --json" in out
    assert movers[0][0] in out and movers[2][0] not in out


def test_command_json_and_rename(files, capsys):
    assert main(["experiments", "diff", files["old"], files["renamed"], "--keys", files["keys"], "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (e,) = out["experiments"]
    assert e["status"] == "renamed" and e["reshuffle"] is True
    assert e["expected"]["moving_share"] == pytest.approx(0.18)
    assert e["observed"]["keys"] == 2000 and len(e["observed"]["movers_list"]) == e["observed"]["movers"]
    assert main(["experiments", "diff", files["old"], files["renamed"]]) == 0
    assert "RESHUFFLE: every caller is drawn afresh" in capsys.readouterr().out


def test_command_reads_usage_records(files, capsys):
    keys = "api_keys:\n  - {key: sk-one, id: one}\n  - {key: sk-two, id: two}\n"
    old = files["write"]("old-k.yaml", BACKENDS + keys + "model_experiments:\n" + textwrap.indent(
        experiment("split", [("control", 1), ("candidate", 0)]), "  "))
    new = files["write"]("new-k.yaml", BACKENDS + keys + "model_experiments:\n" + textwrap.indent(
        experiment("split", [("control", 0), ("candidate", 1)]), "  "))
    records = files["write"]("usage.jsonl", "\n".join([
        json.dumps({"key_id": "one", "experiment_id": "split"}), "not json",
        json.dumps({"key_id": "two", "experiment_id": "split"}), json.dumps({"key_id": "one", "experiment_id": "split"}),
        json.dumps({"key_id": None, "experiment_id": "split"}),
    ]))
    assert main(["experiments", "diff", old, new, "--usage-records", records, "--json"]) == 0
    observed = json.loads(capsys.readouterr().out)["experiments"][0]["observed"]
    assert observed["source"] == "usage records" and observed["keys"] == 2
    assert observed["movers_list"] == [{"caller": "one", "from": "control", "to": "candidate"},
                                       {"caller": "two", "from": "control", "to": "candidate"}]


def test_command_errors(files, capsys):
    bad = files["write"]("bad.yaml", "backends: []\n")
    assert main(["experiments", "diff", files["old"], bad]) == 1
    assert "invalid" in capsys.readouterr().err
    assert main(["experiments", "diff", files["old"], files["new"], "--keys", files["old"] + ".missing"]) == 2
    assert "cannot read --keys" in capsys.readouterr().err
    assert main(["experiments", "diff", files["old"], files["new"], "--at", "soon"]) == 2


def test_docs_example_is_what_the_command_prints(tmp_path, capsys):
    doc = (Path(__file__).resolve().parents[2] / "docs" / "assignment.md").read_text(encoding="utf-8")
    section = doc.split("## Previewing an edit", 1)[1]
    example = section.split("```\n", 3)[2].split("```", 1)[0]
    text = """
backends:
  - {name: pool, url: "http://127.0.0.1:1", models: [llama-3.1-8b, qwen3-8b]}
model_experiments:
  - name: checkout-model
    model: chat
    variants:
      - {id: control, model: llama-3.1-8b, weight: %d}
      - {id: candidate, model: qwen3-8b, weight: %d}
"""
    (tmp_path / "old.yaml").write_text(text % (90, 10), encoding="utf-8")
    (tmp_path / "new.yaml").write_text(text % (80, 20), encoding="utf-8")
    (tmp_path / "keys.txt").write_text("\n".join(KEYS), encoding="utf-8")
    assert main(["experiments", "diff", str(tmp_path / "old.yaml"), str(tmp_path / "new.yaml"),
                 "--keys", str(tmp_path / "keys.txt"), "--movers", "3", "--at", "2026-01-01T00:00:00Z"]) == 0
    assert capsys.readouterr().out.startswith(example)


# --------------------------------------------------------------------------- POST /admin/config?dry_run=1

SERVED = """
server: {admin_token: adm}
backends:
  - {name: pool-a, url: "demo://", models: [m-a]}
  - {name: pool-b, url: "demo://", models: [m-b]}
model_experiments:
  - name: split
    model: chat
    response_headers: true
    variants:
      - {id: control, model: m-a, weight: %d}
      - {id: candidate, model: m-b, weight: %d}
"""


@pytest.fixture(scope="module")
def served(stack_factory):
    return stack_factory(SERVED % (90, 10))


def dry_run(stack, body, token="adm", query="?dry_run=1"):
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.post(f"http://{stack.sidecar_admin[0]}/admin/config{query}", content=body, headers=headers)


@pytest.mark.integration
def test_dry_run_answers_the_diff_against_the_running_config_and_applies_nothing(served):
    r = dry_run(served, (SERVED % (80, 20)).encode())
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["dry_run"] is True and body["warnings"] == []
    (e,) = body["experiments"]
    assert e["experiment"] == "split" and e["status"] == "changed" and e["reshuffle"] is False
    assert e["expected"]["moves"] == [{"from": "control", "to": "candidate", "share": pytest.approx(0.1)}]
    assert e["observed"] is None
    # The same document as the command prints for the same two configs.
    offline = diff(parse(SERVED % (90, 10), env={}).config, parse(SERVED % (80, 20), env={}).config,
                   body["unix_time"]).to_dict()
    assert {k: v for k, v in body.items() if k not in ("dry_run", "warnings")} == offline
    # Nothing was applied: a caller the edit would move still gets control.
    mover = next(k for k in KEYS if assign("split", [("control", 80), ("candidate", 20)], k).variant_id == "candidate"
                 and assign("split", [("control", 90), ("candidate", 10)], k).variant_id == "control")
    r = httpx.post(served.url + "/v1/chat/completions", json={"model": "chat", "messages": []},
                   headers={"authorization": f"Bearer {mover}"})
    assert r.status_code == 200 and r.headers["x-continuum-experiment-variant"] == "control"
    renamed = dry_run(served, (SERVED % (90, 10)).replace("name: split", "name: split-2").encode()).json()
    assert renamed["experiments"][0]["status"] == "renamed" and renamed["experiments"][0]["reshuffle"] is True


@pytest.mark.integration
def test_dry_run_needs_the_admin_token_and_a_usable_body(served):
    assert dry_run(served, b"x", token=None).status_code == 401
    assert dry_run(served, b"x", token="wrong").status_code == 401
    r = dry_run(served, (SERVED % (80, 20)).encode(), query="")
    assert r.status_code == 400 and "dry_run=1" in r.json()["error"]
    r = dry_run(served, b"\xff\xfe")
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]
    r = dry_run(served, (SERVED % (80, 20)).replace("weight: 20", "weight: -1").encode())
    assert r.status_code == 422
    assert r.json()["errors"] == ["model_experiments[0].variants[1].weight: must be >= 0"]
    r = dry_run(served, b"backends: [")
    assert r.status_code == 422 and "not valid YAML" in r.json()["errors"][0]
    r = dry_run(served, b"#" * (16 * 1024 * 1024 + 1))
    assert r.status_code == 413 and "larger than" in r.json()["error"]


def test_random_experiments_have_no_sticky_callers_to_move():
    v_old, v_new = [("a", 50), ("b", 50)], [("a", 80), ("b", 20)]
    (e,) = diff(config(experiment("exp", v_old, "sticky_key: none")), config(experiment("exp", v_new, "sticky_key: none")),
                NOW, KeyList(KEYS)).experiments
    assert e.expected is None and e.observed is None and not e.reshuffle
    assert any("no sticky callers" in n for n in e.notes)
    assert [(a.variant_id, a.new_share) for a in e.arms] == [("a", Fraction(4, 5)), ("b", Fraction(1, 5))]
