"""``multipart/form-data`` request bodies (uploads of input images), read with a cap.

The body is read off the event loop's socket up to a cap (a longer one is refused with 413
before it is all read) and parsed with the standard library's MIME parser in the thread pool.
"""

from __future__ import annotations

import email.parser
import email.policy
from dataclasses import dataclass

from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from tasks.errors import InvalidJob
from tasks.inputs import InputTooLarge

MAX_FIELDS = 16
"""The most form fields one request may have."""


@dataclass(frozen=True, slots=True)
class FormField:
    """One field of a form: its bytes, and its file name when it is a file."""

    data: bytes
    filename: str | None = None

    @property
    def text(self) -> str:
        try:
            return self.data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidJob(f"a text form field is not UTF-8 ({exc})") from exc


async def read_form(request: Request, max_bytes: int) -> dict[str, FormField]:
    """The fields of ``request``'s multipart body by name (the first of a repeated name);
    :class:`InputTooLarge` past ``max_bytes``, :class:`InvalidJob` for any other body."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise InvalidJob(f"send multipart/form-data, not {content_type or 'no content type'!r}")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > max_bytes:
            raise InputTooLarge(f"the request body is over {max_bytes} bytes; inputs are at most "
                                "artifacts.input_max_bytes each")
    return await run_in_threadpool(parse_form, content_type, bytes(body))


def parse_form(content_type: str, body: bytes) -> dict[str, FormField]:
    """The fields of a ``multipart/form-data`` body of ``content_type`` (boundary included)."""
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    if not message.is_multipart():
        raise InvalidJob("the multipart body has no parts (is its boundary right?)")
    fields: dict[str, FormField] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str):
            raise InvalidJob("a form part has no name (Content-Disposition: form-data; name=...)")
        payload = part.get_payload(decode=True)
        data = payload if isinstance(payload, bytes) else b""
        fields.setdefault(name, FormField(data, part.get_filename()))
        if len(fields) > MAX_FIELDS:
            raise InvalidJob(f"a form of more than {MAX_FIELDS} fields")
    return fields
