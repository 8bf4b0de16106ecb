"""Shared fixtures: real stacks (demo engines + sidecar + Envoy) on loopback."""

from __future__ import annotations

import textwrap
from pathlib import Path

import os

import httpx
import pytest
from hypothesis import settings
from prometheus_client.parser import text_string_to_metric_families

from sidecar.stack import Stack, StackError

# Property tests explore new inputs on every local run; under CI they draw the
# same inputs every time, so a red run reproduces and a green one stays green.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def write_config(directory: Path, text: str, name: str = "config.yaml") -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def stack_factory(tmp_path_factory):
    """Start stacks from config text; every stack started is stopped at module end."""
    stacks: list[Stack] = []

    def make(config_text: str, **kwargs) -> Stack:
        # Free ports are picked by binding and releasing them; on a busy machine
        # another process can take one in between, so a start may be retried.
        for attempt in range(3):
            d = tmp_path_factory.mktemp("stack")
            s = Stack(write_config(d, config_text), workdir=d, **kwargs)
            stacks.append(s)
            try:
                return s.start()
            except StackError as exc:
                text = str(exc).lower()
                if not ("already in use" in text or "cannot listen" in text) or attempt == 2:
                    raise

    yield make
    for s in stacks:
        s.close()


def demo_requests(stack: Stack, backend: str) -> list[dict]:
    return httpx.get(stack.demo_urls[backend] + "/_demo/requests").json()


def clear_demo_requests(stack: Stack) -> None:
    for url in stack.demo_urls.values():
        httpx.delete(url + "/_demo/requests")


def envoy_stat(stack: Stack, name: str) -> int:
    text = httpx.get(f"http://{stack.envoy_admin}/stats", params={"filter": name}).text
    total = 0
    for line in text.splitlines():
        key, _, value = line.partition(": ")
        if key.endswith(name) and value.strip().isdigit():
            total += int(value)
    return total


def sidecar_metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def metric(stack: Stack, name: str, **labels) -> float:
    """A metric summed over every sidecar process."""
    return sum(sidecar_metric(text, name, **labels) for text in stack.metrics_text())
