"""Assignment as a service: the ``experiments assign`` CLI and the gRPC service.

Both are checked against :func:`sidecar.routing.assignment.assign` (the function the
request path uses) and against each other, through real processes: the CLI
as ``python -m sidecar experiments assign`` and the service inside
``python -m sidecar serve``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import grpc
import pytest

from sidecar._proto import assignment_pb2 as pb
from sidecar._proto import assignment_pb2_grpc as pb_grpc
from sidecar.devstack.stack import free_port
from sidecar.routing.assignment import assign, next_boundary
from tools import protogen

REPO = Path(__file__).resolve().parents[2]
PROTO_PACKAGE = REPO / "sidecar" / "_proto"

WEEK = 7 * 86400
T0 = 1767225600  # 2026-01-01T00:00:00Z
MODELS = {"control": "m1", "candidate": "m2", "paused": "m3"}
SPLIT = [("control", 70), ("paused", 0), ("candidate", 30)]
WEEKLY = [("control", 50), ("candidate", 50)]


def config_text(split=SPLIT) -> str:
    def variants(vs):
        return "\n".join(
            f"      - {{id: {vid}, model: {MODELS[vid]}, weight: {w}}}" for vid, w in vs
        )

    return (
        textwrap.dedent(
            """\
            backends:
              - {name: a, url: "http://127.0.0.1:9", models: [m1, m2, m3]}
            model_experiments:
              - name: split
                model: chat
                variants:
            %s
              - name: weekly
                model: chat-weekly
                sticky_ttl: 7d
                variants:
            %s
              - name: anonymous
                model: chat-anon
                sticky_key: none
                variants:
            %s
            """
        )
        % (variants(split), variants(WEEKLY), variants(WEEKLY))
    )


def keys_per_arm(experiment, variants, per_arm, prefix="user-", **kw) -> list[str]:
    """The first ``per_arm`` keys landing in each positive-weight arm."""
    want = {vid: per_arm for vid, w in variants if w > 0}
    out = []
    i = 0
    while any(want.values()):
        key = f"{prefix}{i}"
        vid = assign(experiment, variants, key, **kw).variant_id
        if want[vid]:
            want[vid] -= 1
            out.append(key)
        i += 1
    return out


def key_changing_at_boundary(start=0) -> tuple[str, float]:
    """A weekly key whose arm at T0 differs from its arm in the next window."""
    for i in range(start, start + 1000):
        key = f"session-{i}"
        b = next_boundary("weekly", key, WEEK, T0)
        before = assign("weekly", WEEKLY, key, ttl_seconds=WEEK, unix_time=b - 0.5).variant_id
        after = assign("weekly", WEEKLY, key, ttl_seconds=WEEK, unix_time=b).variant_id
        if before != after:
            return key, b
    raise AssertionError("no key changes arm at its boundary")


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("assign") / "router.yaml"
    path.write_text(config_text(), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- CLI


def cli(config: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", "experiments", "assign", "--config", str(config), *args],
        cwd=REPO, capture_output=True, text=True, timeout=60,
        env={**os.environ, "TZ": "IST-5:30"},  # not UTC, so naive times must not be read as local
    )


def cli_many(config: Path, argvs: list[list[str]]) -> list[subprocess.CompletedProcess]:
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(lambda argv: cli(config, *argv), argvs))


def field(stdout: str, name: str) -> str:
    m = re.search(rf"^{re.escape(name)}\s+(.*?)\s*$", stdout, flags=re.M)
    assert m, f"no '{name}' line in:\n{stdout}"
    return m.group(1)


def winner_row(stdout: str) -> list[str]:
    rows = [line.split() for line in stdout.splitlines() if line.startswith("*")]
    assert len(rows) == 1, stdout
    return rows[0]


def test_cli_prints_the_arm_without_ttl(config_path):
    keys = keys_per_arm("split", SPLIT, 3)
    runs = cli_many(config_path, [["--experiment", "split", "--key", k] for k in keys])
    seen = set()
    for key, run in zip(keys, runs):
        assert run.returncode == 0, run.stderr
        want = assign("split", SPLIT, key).variant_id
        seen.add(want)
        assert field(run.stdout, "arm") == want
        assert field(run.stdout, "upstream model") == MODELS[want]
        assert field(run.stdout, "assignment").startswith("sticky")
        assert field(run.stdout, "window").startswith("none")
        assert winner_row(run.stdout)[1] == want
        assert "Smallest score wins" in run.stdout
    assert seen == {"control", "candidate"}


def test_cli_score_table(config_path):
    key = keys_per_arm("split", SPLIT, 1)[-1]
    run = cli(config_path, "--experiment", "chat", "--key", key)  # the client model works too
    assert run.returncode == 0, run.stderr
    got = assign("split", SPLIT, key)
    lines = run.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["variant", "model"])
    table = [line.lstrip("* ").split() for line in lines[header + 1 : header + 1 + len(SPLIT)]]
    for cells, score in zip(table, got.scores):
        assert cells[0] == score.variant_id and cells[1] == MODELS[score.variant_id]
        assert int(cells[2]) == score.weight
        if score.weight == 0:
            assert cells[3] == "-" and cells[4] == "inf"
        else:
            assert cells[3] == f"{score.u:.12g}" and cells[4] == f"{score.score:.12g}"


def test_cli_ttl_both_sides_of_a_boundary(config_path):
    key, b = key_changing_at_boundary()
    iso = datetime.fromtimestamp(b, UTC)
    cases = [
        (str(b - 0.5), b - 0.5),
        (str(int(b)), b),
        (iso.strftime("%Y-%m-%dT%H:%M:%SZ"), b),
        (iso.strftime("%Y-%m-%dT%H:%M:%S"), b),  # naive: UTC
        ((iso - timedelta(seconds=1)).astimezone(timezone(timedelta(hours=5, minutes=30))).isoformat(), b - 1),
        (str(T0), T0),
    ]
    runs = cli_many(config_path, [["--experiment", "weekly", "--key", key, "--at", at] for at, _ in cases])
    arms = []
    for (at, t), run in zip(cases, runs):
        assert run.returncode == 0, (at, run.stderr)
        want = assign("weekly", WEEKLY, key, ttl_seconds=WEEK, unix_time=t)
        arms.append(want.variant_id)
        assert field(run.stdout, "arm") == want.variant_id, at
        window = field(run.stdout, "window")
        assert window.startswith(f"{want.window} of sticky_ttl 7d"), (at, window)
        ends = next_boundary("weekly", key, WEEK, t)
        assert f"(unix {int(ends)})" in field(run.stdout, "window ends"), at
    assert arms[0] != arms[1] and arms[1:4] == [arms[1]] * 3 and arms[4] == arms[5] == arms[0]


def test_cli_json(config_path):
    key, b = key_changing_at_boundary()
    argvs = [
        ["--experiment", "weekly", "--key", key, "--at", str(b - 0.5), "--json"],
        ["--experiment", "chat-weekly", "--key", key, "--at", str(int(b)), "--json"],
    ] + [["--experiment", "split", "--key", k, "--json"] for k in keys_per_arm("split", SPLIT, 1)]
    runs = cli_many(config_path, argvs)
    winners = set()
    for argv, run in zip(argvs, runs):
        assert run.returncode == 0, run.stderr
        doc = json.loads(run.stdout)
        name = "split" if argv[1] == "split" else "weekly"
        variants = SPLIT if name == "split" else WEEKLY
        ttl = WEEK if name == "weekly" else None
        at = doc["unix_time"]
        if "--at" in argv:
            assert at == float(argv[argv.index("--at") + 1])
        want = assign(name, variants, argv[3], ttl_seconds=ttl, unix_time=at)
        winners.add((name, want.variant_id))
        assert doc["experiment"] == name and doc["algorithm"] == "mr-exp-v1"
        assert doc["client_model"] == {"split": "chat", "weekly": "chat-weekly"}[name]
        assert doc["variant_id"] == want.variant_id and doc["variant_model"] == MODELS[want.variant_id]
        assert doc["sticky"] is True and doc["sticky_key"] == "api_key"
        assert doc["sticky_ttl"] == ttl and doc["window"] == want.window
        if ttl:
            assert doc["next_boundary"] == next_boundary(name, argv[3], ttl, at)
        else:
            assert doc["next_boundary"] is None
        assert [s["variant_id"] for s in doc["scores"]] == [vid for vid, _ in variants]
        for s, ref in zip(doc["scores"], want.scores):
            assert s["weight"] == ref.weight and s["model"] == MODELS[ref.variant_id]
            if ref.weight == 0:
                assert s["u"] is None and s["score"] is None
            else:
                assert s["u"] == ref.u and s["score"] == ref.score
    assert winners == {("weekly", "control"), ("weekly", "candidate"), ("split", "control"), ("split", "candidate")}


def test_cli_random_draws(config_path):
    blank, anon = cli_many(config_path, [
        ["--experiment", "split", "--key", "  ", "--json"],
        ["--experiment", "anonymous", "--key", "user-1", "--json"],
    ])
    for run in (blank, anon):
        assert run.returncode == 0, run.stderr
        doc = json.loads(run.stdout)
        assert doc["sticky"] is False and doc["window"] is None and doc["next_boundary"] is None
        assert doc["variant_id"] in ("control", "candidate")
    assert json.loads(anon.stdout)["sticky_key"] == "none"


def test_cli_unknown_experiment_exits_1(config_path):
    run = cli(config_path, "--experiment", "no-such-experiment", "--key", "user-1")
    assert run.returncode == 1
    assert "unknown experiment 'no-such-experiment'" in run.stderr
    assert "split" in run.stderr  # lists the known ones
    assert run.stdout == ""


def test_cli_invalid_config_prints_every_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        config_text().replace("weight: 70", "weight: -1").replace("sticky_ttl: 7d", "sticky_ttl: 5s"),
        encoding="utf-8",
    )
    run = cli(bad, "--experiment", "split", "--key", "user-1")
    assert run.returncode == 1
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2, run.stderr
    assert any("model_experiments[0].variants[0].weight" in e for e in errors)
    assert any("model_experiments[1].sticky_ttl" in e for e in errors)
    assert "invalid (2 error(s))" in run.stderr


def test_cli_bad_time_is_a_usage_error(config_path):
    run = cli(config_path, "--experiment", "weekly", "--key", "user-1", "--at", "next tuesday")
    assert run.returncode == 2 and "--at" in run.stderr


def test_docs_cli_example_is_real_output(tmp_path):
    text = (REPO / "docs" / "assignment.md").read_text(encoding="utf-8").split("## Asking the router", 1)[1]
    command, output = re.findall(r"```(?:sh)?\n(.*?)```", text, flags=re.S)[:2]
    args = command.replace("\\\n", " ").split()
    assert args[:3] == ["model-router", "experiments", "assign"]
    config = tmp_path / args[args.index("--config") + 1]
    config.write_text(textwrap.dedent("""\
        backends:
          - {name: a, url: "http://127.0.0.1:9", models: [llama-3.1-8b, qwen3-8b]}
        model_experiments:
          - name: checkout-model
            model: chat
            sticky_ttl: 7d
            variants:
              - {id: control, model: llama-3.1-8b, weight: 50}
              - {id: candidate, model: qwen3-8b, weight: 50}
        """), encoding="utf-8")
    rest = args[3:]
    rest[rest.index("--config") + 1] = str(config)
    run = subprocess.run(
        [sys.executable, "-m", "sidecar", "experiments", "assign", *rest],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.rstrip() == output.rstrip()


# --------------------------------------------------------------------------- gRPC


@contextlib.contextmanager
def running_sidecar(config: Path, log: Path):
    """``python -m sidecar serve`` on free ports; yields the gRPC address once ready."""
    grpc_addr = f"127.0.0.1:{free_port()}"
    admin_addr = f"127.0.0.1:{free_port()}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "serve", "--config", str(config),
             "--grpc-listen", grpc_addr, "--admin-listen", admin_addr],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"sidecar exited with {proc.returncode}:\n{log.read_text()}")
            try:
                with urllib.request.urlopen(f"http://{admin_addr}/readyz", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"sidecar not ready after 30 s:\n{log.read_text()}")
            time.sleep(0.05)
        yield grpc_addr
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def assignment_stub(addr: str):
    channel = grpc.insecure_channel(addr)
    try:
        yield pb_grpc.AssignmentStub(channel)
    finally:
        channel.close()


@pytest.fixture(scope="module")
def stub(config_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("sidecar") / "sidecar.log"
    with running_sidecar(config_path, log) as addr, assignment_stub(addr) as s:
        yield s


def call(stub, experiment, sticky_value, unix_time=None) -> pb.AssignResponse:
    req = pb.AssignRequest(experiment=experiment, sticky_value=sticky_value)
    if unix_time is not None:
        req.unix_time = unix_time
    return stub.Assign(req, timeout=10)


def check_against_assign(resp: pb.AssignResponse, experiment, variants, key, ttl=None, unix_time=None):
    """Assert that ``resp`` is exactly what :func:`assign` gives."""
    want = assign(experiment, variants, key, ttl_seconds=ttl, unix_time=unix_time)
    assert resp.experiment == experiment
    assert resp.variant_id == want.variant_id
    assert resp.variant_model == MODELS[want.variant_id]
    assert resp.sticky is True
    assert resp.algorithm == "mr-exp-v1"
    if ttl is None:
        assert not resp.HasField("window") and not resp.HasField("next_boundary")
        assert not resp.HasField("sticky_ttl")
    else:
        assert resp.sticky_ttl == ttl
        assert resp.window == want.window
        assert resp.next_boundary == next_boundary(experiment, key, ttl, unix_time)
    assert len(resp.scores) == len(variants)
    for got, ref in zip(resp.scores, want.scores):
        assert (got.variant_id, got.weight, got.model) == (ref.variant_id, ref.weight, MODELS[ref.variant_id])
        if ref.weight == 0:
            assert not got.HasField("u") and got.score == math.inf
        else:
            assert got.HasField("u") and got.u == ref.u and got.score == ref.score
    return want.variant_id


def test_grpc_agrees_with_assign_for_many_keys(stub):
    seen = set()
    for i in range(300):
        key = f"user-{i}"
        seen.add(("split", check_against_assign(call(stub, "split", key), "split", SPLIT, key)))
        t = T0 + i * 7919.25
        resp = call(stub, "weekly", key, t)
        seen.add(("weekly", check_against_assign(resp, "weekly", WEEKLY, key, WEEK, t)))
        assert resp.unix_time == t
    assert seen == {("split", "control"), ("split", "candidate"), ("weekly", "control"), ("weekly", "candidate")}


def test_grpc_accepts_the_client_model(stub):
    for key in ("user-1", "user-2", "José-用户-7"):
        by_model = call(stub, "chat-weekly", key, T0)
        assert by_model == call(stub, "weekly", key, T0)
        assert by_model.client_model == "chat-weekly"
        check_against_assign(by_model, "weekly", WEEKLY, key, WEEK, T0)


def test_grpc_ttl_both_sides_of_a_boundary(stub):
    key, b = key_changing_at_boundary()
    before = call(stub, "weekly", key, b - 0.5)
    at = call(stub, "weekly", key, b)
    check_against_assign(before, "weekly", WEEKLY, key, WEEK, b - 0.5)
    check_against_assign(at, "weekly", WEEKLY, key, WEEK, b)
    assert before.variant_id != at.variant_id
    assert at.window == before.window + 1
    assert before.next_boundary == b and at.next_boundary == b + WEEK


def test_grpc_default_time_is_now(stub):
    key = "user-7"
    t1 = time.time()
    resp = call(stub, "weekly", key)
    t2 = time.time()
    assert t1 - 1 <= resp.unix_time <= t2 + 1
    check_against_assign(resp, "weekly", WEEKLY, key, WEEK, resp.unix_time)
    assert resp.next_boundary - WEEK <= resp.unix_time < resp.next_boundary


def test_grpc_random_draws(stub):
    arms = set()
    for i in range(200):
        for experiment, key in (("split", ""), ("split", " \t"), ("anonymous", f"user-{i}")):
            resp = call(stub, experiment, key, T0)
            assert resp.sticky is False
            assert not resp.HasField("window") and not resp.HasField("next_boundary")
            assert resp.variant_id in ("control", "candidate")  # never the weight-0 arm
            assert resp.variant_model == MODELS[resp.variant_id]
            winner = min(resp.scores, key=lambda s: s.score)
            assert winner.variant_id == resp.variant_id
            arms.add((experiment, resp.variant_id))
    assert arms == {(e, v) for e in ("split", "anonymous") for v in ("control", "candidate")}


def test_grpc_errors(stub):
    with pytest.raises(grpc.RpcError) as exc:
        call(stub, "no-such-experiment", "user-1")
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    assert "unknown experiment 'no-such-experiment'" in exc.value.details()
    with pytest.raises(grpc.RpcError) as exc:
        call(stub, "", "user-1")
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "experiment is required" in exc.value.details()
    for bad_time in (math.nan, math.inf, -1e15):
        with pytest.raises(grpc.RpcError) as exc:
            call(stub, "weekly", "user-1", bad_time)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad_time


def test_grpc_matches_cli(stub, config_path):
    key, b = key_changing_at_boundary()
    cases = [("weekly", key, b - 0.5), ("chat-weekly", key, b), ("split", "user-3", T0), ("chat", "user-12", T0)]
    runs = cli_many(config_path, [["--experiment", e, "--key", k, "--at", repr(t), "--json"] for e, k, t in cases])
    for (experiment, key, t), run in zip(cases, runs):
        assert run.returncode == 0, run.stderr
        doc = json.loads(run.stdout)
        resp = call(stub, experiment, key, t)
        for name in ("algorithm", "experiment", "client_model", "sticky_key", "variant_id", "variant_model",
                     "sticky", "unix_time"):
            assert getattr(resp, name) == doc[name], (experiment, key, name)
        for name in ("sticky_ttl", "window", "next_boundary"):  # optional: unset is null
            assert (getattr(resp, name) if resp.HasField(name) else None) == doc[name], (experiment, key, name)
        assert len(doc["scores"]) == len(resp.scores)
        for s, r in zip(doc["scores"], resp.scores):
            assert (s["variant_id"], s["model"], s["weight"]) == (r.variant_id, r.model, r.weight)
            assert s["u"] == (r.u if r.HasField("u") else None)
            assert s["score"] == (r.score if math.isfinite(r.score) else None)
        assert field(cli(config_path, "--experiment", experiment, "--key", key, "--at", repr(t)).stdout, "arm") == resp.variant_id


def test_grpc_follows_config_reload(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text(config_text(), encoding="utf-8")
    new_split = [("control", 70), ("paused", 40), ("candidate", 90)]
    keys = [f"user-{i}" for i in range(100)]
    old = {k: assign("split", SPLIT, k).variant_id for k in keys}
    new = {k: assign("split", new_split, k).variant_id for k in keys}
    moved = [k for k in keys if old[k] != new[k]]
    assert moved and any(new[k] == "paused" for k in moved)
    with running_sidecar(path, tmp_path / "sidecar.log") as addr, assignment_stub(addr) as s:
        assert {k: call(s, "split", k).variant_id for k in keys} == old
        tmp = tmp_path / "router.yaml.new"
        tmp.write_text(config_text(new_split), encoding="utf-8")
        os.replace(tmp, path)
        deadline = time.monotonic() + 10
        while call(s, "split", moved[0]).variant_id != new[moved[0]]:
            assert time.monotonic() < deadline, "the sidecar did not pick up the edited config within 10 s"
            time.sleep(0.1)
        for k in keys:
            check_against_assign(call(s, "split", k), "split", new_split, k)


# --------------------------------------------------------------------------- generated code


def test_generated_code_is_current(tmp_path):
    written = protogen.generate(tmp_path / "_proto")
    fresh = {p.name: p.read_bytes() for p in written}
    checked_in = {
        p.name: p.read_bytes() for p in PROTO_PACKAGE.iterdir() if p.is_file() and p.suffix in (".py", ".pyi")
    }
    assert sorted(fresh) == sorted(checked_in), "run: python -m tools.protogen"
    for name in fresh:
        assert fresh[name] == checked_in[name], f"sidecar/_proto/{name} is out of date; run: python -m tools.protogen"
    grpc_module = fresh["assignment_pb2_grpc.py"].decode()
    assert "from . import assignment_pb2 as" in grpc_module
    assert "from model_router" not in grpc_module


def test_protogen_refuses_an_unrecognised_import():
    with pytest.raises(RuntimeError):
        protogen._relative_imports("import grpc\n", "model_router.v1", "x_pb2_grpc.py")
    text = "from model_router.v1 import a_pb2 as x\nfrom google.protobuf import empty_pb2\n"
    assert protogen._relative_imports(text, "model_router.v1", "x") == (
        "from . import a_pb2 as x\nfrom google.protobuf import empty_pb2\n"
    )
