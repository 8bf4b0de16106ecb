"""multipart/form-data read the way every common engine reads it, or refused.

Engines parse forms with Starlette (``python-multipart``: vLLM, SGLang) or
aiohttp, and the two disagree on many malformed or unusual bodies: which
``model`` wins when there are two, ``name=model`` without quotes, RFC 2231
``name*=``, bytes before the first delimiter, bare LF line ends, a part's own
``Content-Length`` or ``Content-Transfer-Encoding``, charsets. The router reads
only the grammar on which they agree and refuses everything else with 400
``invalid_multipart``, so the model it judges is the model the engine runs.

What is accepted:

- ``Content-Type: multipart/form-data; boundary=...`` (plus at most
  ``charset=utf-8``); parameters as RFC 9110 tokens or quoted strings without
  backslashes, quotes or semicolons inside, each named once.
- The body starts with the first delimiter line; every line break is CRLF;
  no part's value begins with the delimiter (aiohttp ends the part there);
  a part's header lines are ``token: value`` (no folding, each name once),
  limited to ``Content-Disposition: form-data; name=...[; filename=...]`` and
  ``Content-Type`` (not ``multipart/*``).
- Every field that is not a file and is untyped or ``text/*`` is UTF-8 text
  (aiohttp decodes such fields and fails the whole form otherwise).
- Exactly one part named ``model`` (compared without case, so ``MODEL`` is a
  second one), spelled ``model``, without a filename, as UTF-8 text.
"""

from __future__ import annotations

from dataclasses import dataclass

from .body import BodyError, check_model_name

_TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
# RFC 2046 boundary characters, without the space.
_BCHARS = frozenset("'()+_,-./:=?0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_OWS = " \t"
_PART_HEADERS = frozenset({"content-disposition", "content-type"})
# A part whose name reads as one of these (without case) is judged.
_MODEL = "model"
# aiohttp takes a first field of this name as the charset of every later field.
_CHARSET_FIELD = "_charset_"
# aiohttp refuses longer part header lines; python-multipart reads them.
_MAX_HEADER_LINE = 8000


def _refuse(message: str) -> BodyError:
    return BodyError("invalid_multipart", message, param=None)


@dataclass(frozen=True)
class FormField:
    value: bytes
    start: int  # offset of the value in the body
    end: int


def _quoted(text: str, pos: int, what: str) -> tuple[str, int]:
    """A quoted-string starting at ``text[pos] == '"'``: (its content, the index after it)."""
    end = text.find('"', pos + 1)
    if end < 0:
        raise _refuse(f"The {what} has an unterminated quoted value.")
    value = text[pos + 1:end]
    if "\\" in value or ";" in value:
        raise _refuse(f"The {what} has a quoted value with a backslash or a semicolon, which parsers read differently.")
    if value.startswith("/"):
        raise _refuse(f"The {what} has a quoted value starting with '/', which aiohttp drops.")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise _refuse(f"The {what} has a control character in a quoted value.")
    return value, end + 1


def parse_params(text: str, what: str) -> tuple[str, dict[str, str]]:
    """``value *( OWS ";" OWS name "=" (token / quoted-string) )``, strictly.

    Returns the leading value (lower case) and the parameters (names in lower
    case). Refuses what engine-side parsers split or decode differently:
    whitespace around ``=``, a parameter named twice, RFC 2231 ``name*=``
    forms, empty parameters and anything that is neither a token nor a plain
    quoted string.
    """
    head, sep, rest = text.partition(";")
    value = head.strip(_OWS)
    if not value or any(c not in _TOKEN and c != "/" for c in value):
        raise _refuse(f"The {what} is malformed.")
    params: dict[str, str] = {}
    pos = 0
    while sep:
        while pos < len(rest) and rest[pos] in _OWS:
            pos += 1
        eq = rest.find("=", pos)
        name = rest[pos:eq] if eq >= 0 else rest[pos:]
        if eq < 0 or not name or any(c not in _TOKEN for c in name):
            raise _refuse(f"The {what} has a malformed parameter.")
        name = name.lower()
        if "*" in name:
            raise _refuse(f"The {what} uses the RFC 2231 form '{name}=', which form-data does not allow.")
        if name in params:
            raise _refuse(f"The {what} names the '{name}' parameter twice.")
        pos = eq + 1
        if rest[pos:pos + 1] == '"':
            params[name], pos = _quoted(rest, pos, what)
        else:
            end = pos
            while end < len(rest) and rest[end] in _TOKEN:
                end += 1
            if end == pos:
                raise _refuse(f"The {what} has an empty or malformed '{name}' value.")
            params[name], pos = rest[pos:end], end
        while pos < len(rest) and rest[pos] in _OWS:
            pos += 1
        if pos < len(rest) and rest[pos] != ";":
            raise _refuse(f"The {what} has a malformed '{name}' parameter.")
        sep, pos = (";", pos + 1) if pos < len(rest) else ("", pos)
    return value.lower(), params


def form_boundary(content_type: str) -> bytes:
    """The boundary of a ``multipart/form-data`` content type, read strictly."""
    media, params = parse_params(content_type, "multipart content type")
    if media != "multipart/form-data":
        raise _refuse("Expected a multipart/form-data body.")
    extra = set(params) - {"boundary", "charset"}
    if extra:
        raise _refuse(f"The multipart content type has an unexpected parameter '{sorted(extra)[0]}'.")
    if params.get("charset", "utf-8").lower() != "utf-8":
        raise _refuse("The multipart content type may only declare charset=utf-8.")
    boundary = params.get("boundary")
    if boundary is None:
        raise _refuse("The multipart/form-data content type has no boundary.")
    if not 1 <= len(boundary) <= 70 or any(c not in _BCHARS for c in boundary):
        raise _refuse("The multipart boundary must be 1 to 70 of the characters RFC 2046 allows (no spaces).")
    return boundary.encode("ascii")


@dataclass(frozen=True)
class _Part:
    name: str
    has_filename: bool
    content_type: tuple[str, dict[str, str]] | None  # its media type (lower case) and parameters, read once
    value: FormField


def _header_lines(block: bytes) -> dict[str, str]:
    """A part's header block (CRLF-separated, no folding, each name once)."""
    if b"\n" in block.replace(b"\r\n", b"") or b"\r" in block.replace(b"\r\n", b""):
        raise _refuse("A multipart part's headers contain a bare CR or LF line break.")
    headers: dict[str, str] = {}
    for line in block.split(b"\r\n"):
        if len(line) > _MAX_HEADER_LINE:
            raise _refuse(f"A multipart part has a header line over {_MAX_HEADER_LINE} bytes.")
        name, colon, value = line.partition(b":")
        if not colon or not name or any(chr(c) not in _TOKEN for c in name):
            raise _refuse("A multipart part has a malformed header line.")
        key = name.decode("ascii").lower()
        if key in headers:
            raise _refuse(f"A multipart part has the '{key}' header twice.")
        if key not in _PART_HEADERS:
            raise _refuse(f"A multipart part has a '{key}' header, which engines read differently.")
        headers[key] = value.decode("utf-8", "surrogateescape").strip(_OWS)
    return headers


def _part(block: bytes, field: FormField) -> _Part:
    headers = _header_lines(block)
    disposition = headers.get("content-disposition")
    if disposition is None:
        raise _refuse("A multipart part has no Content-Disposition header.")
    kind, params = parse_params(disposition, "Content-Disposition header")
    if kind != "form-data" or "name" not in params or set(params) - {"name", "filename"}:
        raise _refuse("A multipart part's Content-Disposition must be form-data with a name (and an optional filename).")
    ctype = headers.get("content-type")
    read = parse_params(ctype, "part content type") if ctype is not None else None
    if read is not None and read[0].startswith("multipart/"):
        raise _refuse("Nested multipart parts are not accepted.")
    return _Part(params["name"], "filename" in params, read, field)


def _parts(body: bytes, boundary: bytes) -> list[_Part]:
    """Every part of a form, with its name; refuses what engines read differently."""
    delim = b"--" + boundary
    if not body.startswith(delim):
        raise _refuse("The multipart body must begin with its boundary (no preamble).")
    parts: list[_Part] = []
    pos = 0
    while True:
        pos += len(delim)
        if body[pos:pos + 2] == b"--":
            if body[pos + 2:] not in (b"", b"\r\n"):
                raise _refuse("The multipart body has data after its closing boundary.")
            return parts
        if body[pos:pos + 2] != b"\r\n":
            raise _refuse("A multipart boundary line must end right after the boundary.")
        head_end = body.find(b"\r\n\r\n", pos)
        if head_end < 0:
            raise _refuse("A multipart part has no header terminator.")
        if head_end == pos:
            raise _refuse("A multipart part has no Content-Disposition header.")
        start = head_end + 4
        if body.startswith(delim, start):
            # The blank line's CRLF also opens a delimiter for aiohttp, which
            # ends the part here; python-multipart reads on to the next CRLF--boundary.
            raise _refuse("A multipart part's value begins with its boundary, which parsers read differently.")
        nxt = body.find(b"\r\n" + delim, start)
        if nxt < 0:
            raise _refuse("The multipart body is not terminated.")
        parts.append(_part(body[pos + 2:head_end], FormField(body[start:nxt], start, nxt)))
        pos = nxt + 2


def _check_text_fields(parts: list[_Part], model: _Part | None) -> None:
    """aiohttp decodes every field that is not a file and has no type or a
    ``text/*`` one, and fails the whole form on a value its charset cannot
    decode; python-multipart reads such a form. Such fields must be UTF-8
    (``model``, checked as a model name, is not one of them here)."""
    for p in parts:
        if p.has_filename or p is model:
            continue
        media, params = p.content_type or ("text/plain", {})
        if not media.startswith("text/"):
            continue
        if params.get("charset", "utf-8").lower() != "utf-8":
            raise _refuse(f"The form field '{p.name}' declares a charset other than UTF-8.")
        try:
            p.value.value.decode("utf-8")
        except UnicodeDecodeError:
            raise _refuse(f"The form field '{p.name}' is not valid UTF-8 text, which aiohttp refuses.") from None


def _model_part(parts: list[_Part]) -> _Part | None:
    if any(p.name.lower() == _CHARSET_FIELD for p in parts):
        raise _refuse("A '_charset_' form field is not accepted.")
    models = [p for p in parts if p.name.lower() == _MODEL]
    if len(models) > 1:
        raise _refuse("The form has more than one 'model' field.")
    if not models:
        return None
    (part,) = models
    if part.name != _MODEL:
        raise _refuse(f"The form's model field must be named 'model' (got '{part.name}').")
    if part.has_filename:
        raise _refuse("The form's 'model' field must not be a file.")
    if part.content_type is not None:
        media, params = part.content_type
        if media != "text/plain" or set(params) - {"charset"} or params.get("charset", "utf-8").lower() != "utf-8":
            raise _refuse("The form's 'model' field may only be text/plain in UTF-8.")
    return part


def form_model_field(body: bytes, content_type: str) -> FormField | None:
    """The form's ``model`` field, or None when it has none; raises BodyError
    for a form engines could read differently."""
    parts = _parts(body, form_boundary(content_type))
    part = _model_part(parts)
    _check_text_fields(parts, part)
    return part.value if part is not None else None


def form_model(body: bytes, content_type: str) -> tuple[str, FormField]:
    """The model a form names, checked as a model name."""
    field = form_model_field(body, content_type)
    if field is None:
        raise BodyError("missing_model", "The form has no 'model' field.")
    try:
        value = field.value.decode("utf-8")
    except UnicodeDecodeError:
        raise BodyError("invalid_model", "The 'model' field is not valid UTF-8.") from None
    return check_model_name(value), field


def replace_field(body: bytes, field: FormField, value: str) -> bytes:
    return body[: field.start] + value.encode() + body[field.end:]
