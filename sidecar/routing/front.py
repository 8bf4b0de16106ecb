"""The decision's first stages after the parse: names (aliases, a variant
suffix), the per-key model gate, the reservation of hidden arms' models, and
the experiment the client-facing name belongs to.

Their verdicts depend only on the snapshot, on how the ingress reads names,
on the model as sent and on the key's allow-lists, so an untraced request
reads them from a per-snapshot table (:mod:`.memo`); a traced one runs each
stage to record what it saw.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import errors
from ..errors import Reply
from .context import Request
from .memo import PerSnapshot
from .reservation import reserved_by
from .snapshot import ExperimentInfo, Snapshot
from .suffixes import split


@dataclass(frozen=True, slots=True)
class Front:
    """What the first stages conclude for one (ingress reading, model, key)."""

    requested: str  # after model_aliases
    client_model: str  # the base name (without a variant suffix)
    word: str | None  # the variant suffix
    refusal: Reply | None  # the key gate's or the reservation's
    info: ExperimentInfo | None  # the experiment of ``client_model`` (on an ingress that runs experiments)
    allowed: frozenset[str] | None  # the key's allowed_backends


_fronts: PerSnapshot[Front] = PerSnapshot()


def front(snap: Snapshot, req: Request, sent: str) -> Front:
    """The first stages' verdicts for a request that names ``sent``."""
    if req.trace is not None:
        return _compute(snap, req, sent)
    ingress, key = req.ingress, req.caller.key
    models = None if key is None or key.allowed_models is None else tuple(key.allowed_models)
    backends = None if key is None or key.allowed_backends is None else tuple(key.allowed_backends)
    k = (sent, ingress.aliases, ingress.suffixes, ingress.experiments, ingress.family, models, backends)
    found = _fronts.find(snap, k)
    return found if found is not None else _fronts.keep(k, _compute(snap, req, sent))


def _compute(snap: Snapshot, req: Request, sent: str) -> Front:
    requested, client_model, word = names(snap, req, sent)
    refusal = key_gate(req, client_model, sent) or reservation(snap, req, client_model, sent)
    key = req.caller.key
    allowed = frozenset(key.allowed_backends) if key is not None and key.allowed_backends is not None else None
    info = snap.experiments.get(client_model) if req.ingress.experiments else None
    return Front(requested, client_model, word, refusal, info, allowed)


def names(snap: Snapshot, req: Request, sent: str) -> tuple[str, str, str | None]:
    """model_aliases (on the ingresses that honour them), then a variant suffix
    (on those that read them; the exact name wins): (requested, base, suffix)."""
    requested = snap.aliases.get(sent, sent) if req.ingress.aliases else sent
    suffixes = req.ingress.suffixes and snap.config.proxy.variant_suffixes.enabled
    base, word = split(snap, requested) if suffixes else (requested, None)
    if req.trace is not None:
        verdict = f"'{sent}'" + (f" -> '{requested}' by model_aliases" if requested != sent else "")
        if word is not None:
            verdict += f"; variant suffix ':{word}' on base '{base}'"
        req.trace.stage("names", verdict, sent=sent, after_aliases=requested, base=base, suffix=word,
                        aliases_read=req.ingress.aliases, suffixes_read=suffixes)
    return requested, base, word


def key_gate(req: Request, client_model: str, sent: str) -> Reply | None:
    """The per-key model gate judges the client-facing (base) name; its
    refusal names the model as sent (never what an alias stands for)."""
    key = req.caller.key
    allowed = key.allowed_models if key is not None else None
    refused = allowed is not None and client_model not in allowed
    if req.trace is not None:
        verdict = "pass: the key has no allowed_models" if allowed is None else (
            f"refused: '{client_model}' is not in the key's allowed_models" if refused
            else f"pass: '{client_model}' is in the key's allowed_models")
        req.trace.stage("key_gate", verdict, allowed_models=allowed)
    return errors.model_not_permitted(sent, req.ingress.family) if refused else None


def reservation(snap: Snapshot, req: Request, client_model: str, sent: str) -> Reply | None:
    """A reserved variant model named outside its experiment is answered
    exactly like a model the router does not have."""
    reserving = reserved_by(snap, client_model, aliases=req.ingress.aliases)
    if req.trace is not None:
        req.trace.stage("reservation", "not reserved" if reserving is None else (
            f"refused: reserved by the hidden experiment '{reserving}', answered as an unknown model"),
            reserved_by=reserving)
    return errors.model_not_found(sent, req.ingress.family, reserved_by=reserving) if reserving is not None else None
