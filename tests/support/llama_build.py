"""Builds llama.cpp's ``llama-server`` once, for the real-engine tests.

PyPI has no prebuilt ``llama-server``; the ``llama-cpp-python`` sdist vendors a
pinned llama.cpp tree, so pip fetches the source like any other test input and
CMake builds the one target the tests need. The binary is cached outside the
checkout, keyed by the sdist version, so later runs (and other checkouts) reuse
it. ``python -m tests.support.servers`` calls :func:`ensure` so a fresh machine builds it
before pytest; the tests skip when it is absent.

The build is offline once the sdist is on disk: the web UI download is off
(``LLAMA_USE_PREBUILT_UI``), as are HTTPS, tests and examples. The CPU target is
portable (``GGML_NATIVE=OFF``) so a cached binary never meets an instruction the
next machine lacks. ggml's own sources keep their optimisation; the rest
(the server, ``common/``, ``src/``) is compiled at ``-O0``, which roughly halves
the CPU time of the build and costs nothing the tiny test models notice.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python sdist; vendors llama.cpp 0c1e570
ENV_BINARY = "MODEL_ROUTER_LLAMA_SERVER"  # an existing llama-server to use instead

# Compiler launcher: ggml's sources as CMake asked, everything else at -O0.
_LAUNCHER = """#!/bin/sh
src=""; prev=""
for a in "$@"; do [ "$prev" = "-c" ] && src="$a"; prev="$a"; done
case "$src" in */ggml/src/*) exec "$@" ;; esac
n=$#; i=0
while [ $i -lt $n ]; do
  a="$1"; shift; i=$((i+1))
  case "$a" in -O1|-O2|-O3|-Os) a="-O0" ;; esac
  set -- "$@" "$a"
done
exec "$@"
"""

_CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF",
]


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/model-router/llama-server-VERSION`` (``~/.cache`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "model-router" / f"llama-server-{VERSION}"


def cached_binary() -> Path:
    return cache_dir() / "llama-server"


def find() -> Path | None:
    """The binary to test against: ``$MODEL_ROUTER_LLAMA_SERVER`` or the cached build."""
    override = os.environ.get(ENV_BINARY)
    if override:
        return Path(override) if os.access(override, os.X_OK) else None
    path = cached_binary()
    return path if os.access(path, os.X_OK) else None


def _run(cmd: list[str], cwd: Path | None = None, log: Path | None = None) -> None:
    out = open(log, "ab") if log else subprocess.DEVNULL
    try:
        done = subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    finally:
        if log:
            out.close()  # type: ignore[union-attr]
    if done.returncode != 0:
        where = f"; see {log}" if log else ""
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited with {done.returncode}{where}")


def _fetch_source(work: Path, log: Path) -> Path:
    """Download the sdist with pip and unpack its vendored llama.cpp tree."""
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", "llama-cpp-python",
          f"llama-cpp-python=={VERSION}", "-d", str(work / "sdist")], log=log)
    (archive,) = (work / "sdist").glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(work / "src", filter="data")
    (root,) = (work / "src").iterdir()
    return root / "vendor" / "llama.cpp"


def _compile(source: Path, work: Path, log: Path) -> Path:
    launcher = work / "cc-launch.sh"
    launcher.write_text(_LAUNCHER, encoding="utf-8")
    launcher.chmod(0o755)
    build = work / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run(["cmake", "-S", str(source), "-B", str(build), *generator, *_CMAKE_FLAGS,
          f"-DCMAKE_C_COMPILER_LAUNCHER={launcher}", f"-DCMAKE_CXX_COMPILER_LAUNCHER={launcher}"], log=log)
    jobs = str(os.cpu_count() or 2)
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], log=log)
    return build / "bin" / "llama-server"


def build() -> Path:
    """Build into the cache (an atomic rename, so a killed build leaves no binary)."""
    missing = [tool for tool in ("cmake", "c++", "cc") if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(f"building llama-server needs {', '.join(missing)} (Debian: cmake build-essential)")
    target = cache_dir()
    target.mkdir(parents=True, exist_ok=True)
    log = target / "build.log"
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=target, prefix="work-") as tmp:
        work = Path(tmp)
        binary = _compile(_fetch_source(work, log), work, log)
        if shutil.which("strip"):
            _run(["strip", str(binary)])
        staged = target / "llama-server.partial"
        shutil.copy2(binary, staged)
        staged.replace(cached_binary())
    minutes = (time.monotonic() - started) / 60
    print(f"servers: built llama-server {VERSION} in {minutes:.1f} min -> {cached_binary()}", flush=True)
    return cached_binary()


def ensure() -> int:
    """Build the binary unless it is cached (or given by the environment)."""
    found = find()
    if found is not None:
        print(f"servers: llama-server={found}")
        return 0
    print(f"servers: building llama-server {VERSION} from the llama-cpp-python sdist "
          f"(once; cached in {cache_dir()})", flush=True)
    try:
        build()
    except (RuntimeError, OSError, ValueError) as exc:
        print(f"servers: llama-server build failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(ensure())
