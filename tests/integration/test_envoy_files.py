"""The Envoy configs checked into envoy/ are what envoy-config prints, and valid."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sidecar.devstack.stack import envoy_binary

CASES = {
    "envoy/ab-testing.yaml": ["--config", "sidecar/templates/ab-testing.yaml"],
}


@pytest.mark.parametrize("path", sorted(CASES))
def test_checked_in_envoy_config_is_current_and_valid(path):
    out = subprocess.run(
        [sys.executable, "-m", "sidecar", "envoy-config", *CASES[path]], capture_output=True, text=True, check=True
    )
    with open(path, encoding="utf-8") as fh:
        assert fh.read() == out.stdout, f"{path} is stale: regenerate it with model-router envoy-config {' '.join(CASES[path])}"
    res = subprocess.run([envoy_binary(), "--mode", "validate", "-c", path], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
