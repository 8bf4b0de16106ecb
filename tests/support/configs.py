"""Configs that several test files share, so each test states only what differs.

``split_config`` is the common stack of the experiment tests: two demo pools,
``pool-a`` serving ``model-a`` and ``pool-b`` serving ``model-b``, and the
experiment ``split`` on the model ``chat`` sending callers to both arms
(``control`` and ``candidate``, 1:1, response headers on, sticky on the
``x-caller`` header). ``SPLIT_ARMS`` names each arm's model and pool.
"""

from __future__ import annotations

SPLIT_ARMS = {"control": ("model-a", "pool-a"), "candidate": ("model-b", "pool-b")}

_POOLS = """\
backends:
  - {name: pool-a, url: "demo://", models: [model-a]}
  - {name: pool-b, url: "demo://", models: [model-b]}
"""

_SPLIT = """\
model_experiments:
  - name: split
    model: chat
    response_headers: true
    sticky_key: "header:x-caller"
    variants:
      - {id: control, model: model-a, weight: 1}
      - {id: candidate, model: model-b, weight: 1}
"""


def _block(text: str) -> str:
    return text if not text or text.endswith("\n") else text + "\n"


def split_config(before: str = "", *, backends: str = "", between: str = "", experiments: str = "",
                 after: str = "") -> str:
    """The two pools and the ``split`` experiment, as YAML text.

    ``before`` comes first (top-level sections), ``backends`` adds entries
    after the two pools, ``between`` adds top-level sections between the
    backends and the experiments, ``experiments`` adds entries after
    ``split``, ``after`` ends the text. Each is YAML as it would stand in the
    file (entries indented as list items)."""
    return (_block(before) + _POOLS + _block(backends) + _block(between) + _SPLIT + _block(experiments)
            + _block(after))
