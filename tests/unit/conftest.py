"""Unit tests start no process: a test here that tries fails at once.

Anything that starts an engine, Envoy, the sidecar or a server binary belongs
in tests/integration/ (where every test carries the ``integration`` marker)."""

from __future__ import annotations

import asyncio
import subprocess

import pytest


class ProcessStarted(AssertionError):
    """A unit test tried to start a process."""


def _refuse(*args: object, **kwargs: object) -> None:
    raise ProcessStarted("unit tests start no process; move this test to tests/integration/")


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse)
    monkeypatch.setattr(asyncio, "create_subprocess_exec", _refuse)
    monkeypatch.setattr(asyncio, "create_subprocess_shell", _refuse)
