"""Shared fixtures: real stacks (demo engines + sidecar + Envoy) on loopback."""

from __future__ import annotations

import textwrap
from pathlib import Path

import httpx
import pytest

from sidecar.stack import Stack


def write_config(directory: Path, text: str, name: str = "config.yaml") -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def stack_factory(tmp_path_factory):
    """Start stacks from config text; every stack started is stopped at module end."""
    stacks: list[Stack] = []

    def make(config_text: str, **kwargs) -> Stack:
        d = tmp_path_factory.mktemp("stack")
        s = Stack(write_config(d, config_text), workdir=d, **kwargs)
        stacks.append(s)
        return s.start()

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
