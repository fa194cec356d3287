"""Input images of jobs: ``POST /v1/inputs`` (multipart upload) stores one by its digest, which a
job then names (``params.image``: ``sha256:<hex>``); a job may instead carry it as base64, which
its submit stores the same way (:func:`tasks.inputs.store_inputs`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel

from app.api.context import ApiContext, api_context, current_tenant
from app.api.multipart import read_form
from app.tenants import Tenant
from tasks.errors import InvalidJob
from tasks.inputs import InputStore, check_input

router = APIRouter(prefix="/v1", tags=["jobs"])
Ctx = Annotated[ApiContext, Depends(api_context)]
Caller = Annotated[Tenant, Depends(current_tenant)]
FORM_OVERHEAD_BYTES = 64 * 1024
"""What a form adds around its files (boundaries, headers, text fields), at most."""


class StoredInput(BaseModel):
    """An input in the artifact store: name it in a job's params (``image``, ``mask``)."""

    digest: str
    format: str
    width: int
    height: int
    mode: str
    size_bytes: int


def form_cap(ctx: ApiContext, files: int) -> int:
    """The most bytes a form of ``files`` inputs may have."""
    return files * ctx.settings.artifacts.input_max_bytes + FORM_OVERHEAD_BYTES


@router.post("/inputs", status_code=201, response_model=StoredInput,
             responses={413: {"description": "Over the size caps."},
                        422: {"description": "Not a readable image."}},
             summary="Upload an input image or mask (multipart field 'file')")
async def upload_input(request: Request, ctx: Ctx, tenant: Caller) -> StoredInput:
    form = await read_form(request, form_cap(ctx, 1))
    field = form.get("file")
    if field is None:
        raise InvalidJob(f"the form has no 'file' field (it has {sorted(form) or 'none'})")
    return await run_in_threadpool(_store, ctx, field.data)


def _store(ctx: ApiContext, data: bytes) -> StoredInput:
    checked = check_input(data, "file", ctx.settings.artifacts)
    digest = InputStore(ctx.artifacts).put(checked)
    return StoredInput(digest=digest, format=checked.format, width=checked.width,
                       height=checked.height, mode=checked.mode, size_bytes=len(data))
