"""Paths outside the ingress table: refused, or forwarded to one backend."""

from __future__ import annotations

from collections.abc import Sequence

from .. import errors
from ..errors import Reply
from ..payload.body import BodyError
from .context import Caller
from .reservation import reserved_by
from .route import Route, upstream_auth
from .snapshot import Snapshot


def passthrough(
    snap: Snapshot, path: str, caller: Caller, family: str, models: Sequence[str] | BodyError,
) -> Route | Reply:
    """A path outside the ingress table: refused unless ``proxy.passthrough_backend``
    is set, and then sent there untouched, after the gates a model endpoint has.

    A key limited to some models or backends may not use it: the router
    cannot tell which model such a request reaches. A model the request names
    (``models``, read from its query and body) that an experiment reserves is
    refused exactly like an unknown model. A body the router could not read
    (``models`` is the BodyError) is refused: what the router cannot read, an
    engine might, and it would be judged on nothing.
    """
    if snap.passthrough_backend is None:
        return errors.error(
            "unknown_endpoint", f"The path '{path.partition('?')[0]}' is not served by this router.", family
        )
    key = caller.key
    if key is not None and (key.allowed_models is not None or key.allowed_backends is not None):
        return errors.error("model_not_permitted", "This API key may only use the model endpoints.", family)
    if isinstance(models, BodyError):
        return errors.error(models.kind, str(models), family, param=models.param)
    for model in models:
        exp = reserved_by(snap, model)
        if exp is not None:
            return errors.model_not_found(model, family, reserved_by=exp)
    backend = snap.backends[snap.passthrough_backend]
    set_headers, remove_headers = upstream_auth(snap, backend)
    new_path = backend.base_path + path if backend.base_path else None
    return Route(backend, "", "", path=new_path, set_headers=set_headers, remove_headers=remove_headers)
