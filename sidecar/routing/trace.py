"""A decision's trace: what each stage saw and what it concluded.

The stages fill a :class:`Trace` when the request carries one
(``Request.trace``) and skip every record otherwise, so a request without one
pays a ``None`` check per stage. :mod:`sidecar.routing.explain` runs the pipeline with
a trace for ``POST /admin/explain``, ``model-router explain`` and the
``x-model-router-explain`` request header.

Everything recorded is plain JSON, and no key: a caller appears by its key
id, an ``api_key`` sticky value not at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import orjson

from ..errors import Reply
from .route import Route

JSON = dict[str, Any]


@dataclass(slots=True)
class AttemptTrace:
    """One selection: the model it dispatches and every backend it weighed."""

    model: str
    role: str  # "first", or "fallback hop N"
    candidates: dict[str, JSON] = field(default_factory=dict)  # backend -> what each step said
    steps: JSON = field(default_factory=dict)  # preferred, ranker, picker
    chosen: str | None = None

    def candidate(self, backend: str) -> JSON:
        return self.candidates.setdefault(backend, {"backend": backend})

    def verdict(self, backend: str, verdict: str) -> None:
        """A step's conclusion on a candidate; the first exclusion stands."""
        entry = self.candidate(backend)
        if "verdict" not in entry:
            entry["verdict"] = verdict

    def to_dict(self) -> JSON:
        return {
            "model": self.model, "role": self.role, "candidates": list(self.candidates.values()),
            **self.steps, "chosen": self.chosen,
        }


@dataclass(slots=True)
class Trace:
    stages: list[JSON] = field(default_factory=list)
    attempts: list[AttemptTrace] = field(default_factory=list)
    outcome: JSON | None = None

    def stage(self, name: str, verdict: str, **facts: Any) -> None:
        self.stages.append({"stage": name, "verdict": verdict, **facts})

    def attempt(self, model: str, role: str) -> AttemptTrace:
        rec = AttemptTrace(model, role)
        self.attempts.append(rec)
        return rec

    def conclude(self, result: Route | Reply) -> None:
        """The decision's answer: the backend and model it routes to, or the refusal."""
        if isinstance(result, Reply) and result.status < 400:
            self.outcome = {"verdict": f"answered by the sidecar itself ({result.status})", "status": result.status}
            return
        if isinstance(result, Reply):
            code = _code(result.body)
            self.outcome = {"verdict": f"refused: {result.status} {code}", "status": result.status, "code": code}
            return
        plan = result.plan
        fallback = plan.fallback if plan is not None else None
        self.outcome = {
            "verdict": f"routed to backend {result.backend.name} as model '{result.upstream_model}'",
            "backend": result.backend.name,
            "upstream_model": result.upstream_model,
            "path": result.path,
            "fallback": None if fallback is None else {"from": fallback.origin, "to": fallback.served},
        }

    def find(self, name: str) -> JSON | None:
        return next((s for s in self.stages if s["stage"] == name), None)

    def to_dict(self) -> JSON:
        return {"stages": self.stages, "selection": [a.to_dict() for a in self.attempts], "outcome": self.outcome}

    def summary(self) -> str:
        """The trace in one header value: ``key=value`` pairs separated by ``; ``."""
        parts: list[tuple[str, str]] = []
        names = self.find("names")
        if names is not None:
            parts.append(("model", str(names["base"])))
            if names.get("suffix"):
                parts.append(("suffix", str(names["suffix"])))
        for stage in ("authenticate", "key_gate", "reservation"):
            s = self.find(stage)
            if s is not None and s["verdict"].startswith("refused"):
                parts.append((stage, "refused"))
        exp = self.find("experiment")
        if exp is not None and exp.get("experiment"):
            parts.append(("experiment", str(exp["experiment"])))
            parts.append(("arm", f"{exp['arm']} ({exp['assignment']})"))
            parts.append(("scores", ",".join(
                f"{v['variant_id']}={_g(v['score'])}" for v in exp["scores"] if v["score"] is not None
            )))
        for a in self.attempts:
            excluded = [f"{c['backend']}:{c['reason']}" for c in a.candidates.values() if "reason" in c]
            ranker = a.steps.get("ranker")
            label = "attempt" if a.role == "first" else "hop"
            parts.append((label, f"{a.model}->{a.chosen or 'none'}"))
            if ranker is not None:
                parts.append(("ranker", f"{ranker['name']} {'applied' if ranker['applied'] else 'not applied'}"))
            if excluded:
                parts.append(("excluded", ",".join(excluded)))
        out = self.outcome
        if out is not None and "backend" in out:
            parts += [("backend", str(out["backend"])), ("upstream", str(out["upstream_model"]))]
        elif out is not None:
            parts.append(("refused", f"{out['status']} {out['code']}") if "code" in out else ("answered", str(out["status"])))
        return "; ".join(f"{k}={quote(v, safe=' :/(),=->._@+*')}" for k, v in parts)


def _code(body: bytes) -> str:
    """The error code of a refusal's body (OpenAI ``code``, else Anthropic ``type``)."""
    try:
        err = orjson.loads(body).get("error", {})
    except (orjson.JSONDecodeError, AttributeError):
        return "error"
    return str(err.get("code") or err.get("type") or "error")


def _g(x: float) -> str:
    return f"{x:.6g}"
