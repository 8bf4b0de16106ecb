"""Unit tests start no process: a test here that tries fails at once.

Anything that starts an engine, Envoy, the sidecar or a server binary belongs
in tests/integration/ (where every test carries the ``integration`` marker).
The refusal covers a test's whole setup, call and teardown, so a module- or
session-scoped fixture that starts a process is refused too."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import Iterator
from unittest import mock

import pytest


class ProcessStarted(AssertionError):
    """A unit test tried to start a process."""


def _refuse(*args: object, **kwargs: object) -> None:
    raise ProcessStarted("unit tests start no process; move this test to tests/integration/")


@contextlib.contextmanager
def _no_processes() -> Iterator[None]:
    with (
        mock.patch.object(subprocess.Popen, "__init__", _refuse),
        mock.patch.object(asyncio, "create_subprocess_exec", _refuse),
        mock.patch.object(asyncio, "create_subprocess_shell", _refuse),
    ):
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _no_processes():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _no_processes():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    with _no_processes():
        return (yield)
