"""/v1/adapters: the LoRA adapters jobs may name, from the configured adapter folder."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from app.api.context import ApiContext, api_context, current_tenant
from app.schemas import AdapterInfo, AdapterList
from app.tenants import Tenant
from workers.diffusion.adapters import adapter_registry

router = APIRouter(prefix="/v1", tags=["adapters"])
Ctx = Annotated[ApiContext, Depends(api_context)]
Caller = Annotated[Tenant, Depends(current_tenant)]


@router.get("/adapters", response_model=AdapterList,
            summary="LoRA adapters a diffusion job may name (params.adapters), by name")
def list_adapters(ctx: Ctx, tenant: Caller) -> AdapterList:
    registry = adapter_registry(ctx.settings.diffusion.adapters_dir)
    return AdapterList(data=[AdapterInfo(**spec.summary()) for spec in registry.all()])
