"""The live SLO dashboard: ``/dashboard`` (plain HTML, vanilla JS and a vendored uPlot; no build
step) polling ``/v1/dashboard/data`` every second: the /v1/stats figures and the worker timeline."""

from __future__ import annotations

import base64
import hashlib
import hmac
import html
import json
import secrets
import threading
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Security
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.security import APIKeyCookie, APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field

from app.api.context import ApiContext, api_context
from app.api.stats import OPERATOR, LiveStatsView, Viewer, live_stats
from app.api.timeline import Timeline, read_timeline
from app.tenants import TenantDirectory, read_or_create_secret
from tasks.settings import Settings

STATIC_DIR = Path(__file__).resolve().parents[1] / "static"
TOKEN_FILE = "dashboard-token"
COOKIE = "stepline_dashboard"
SESSION_S = 8 * 3600
"""A session outlives neither this nor a change of the dashboard token (its signing key)."""

ASSETS = {  # URL name → (file under STATIC_DIR, media type); nothing else is served
    "dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
    "uPlot.iife.min.js": ("vendor/uplot/uPlot.iife.min.js", "text/javascript; charset=utf-8"),
    "uPlot.min.css": ("vendor/uplot/uPlot.min.css", "text/css; charset=utf-8"),
}

PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

UNAUTHORIZED = ("no dashboard session: open /dashboard?token=<token> with the read-only token "
                "(api.dashboard_token, or <run_dir>/dashboard-token) or an API key, or send "
                "'Authorization: Bearer <key>' / 'X-API-Key: <key>'")

router = APIRouter(tags=["dashboard"])
Ctx = Annotated[ApiContext, Depends(api_context)]

_bearer = HTTPBearer(auto_error=False, description="Authorization: Bearer <API key>")
_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="X-API-Key: <API key>")
_session = APIKeyCookie(name=COOKIE, auto_error=False,
                        description="The dashboard session /dashboard?token= sets")


def dashboard_token(settings: Settings) -> str:
    """The read-only dashboard token: ``api.dashboard_token``, else the one generated once into
    ``<run_dir>/dashboard-token`` (mode 0600)."""
    return settings.api.dashboard_token or read_or_create_secret(
        Path(settings.run_dir) / TOKEN_FILE, lambda: "sld-" + secrets.token_urlsafe(32))


@dataclass(frozen=True)
class DashboardAccess:
    """Who may look, and their sessions. A browser cannot send a Bearer header when it navigates,
    so ``/dashboard?token=T`` trades ``T`` for an HttpOnly cookie, HMAC-signed with a key derived
    from the dashboard token (so changing the token ends every session), and redirects to a URL
    without it. ``T`` is the read-only dashboard token (``api.dashboard_token``, else
    ``<run_dir>/dashboard-token``), which sees every job id, or an API key, which sees its own
    tenant's only."""

    token: str
    tenants: TenantDirectory

    @classmethod
    def from_settings(cls, settings: Settings, tenants: TenantDirectory) -> DashboardAccess:
        return cls(token=dashboard_token(settings), tenants=tenants)

    def viewer_of(self, presented: str | None) -> Viewer | None:
        """The viewer a presented token stands for: the operator, a tenant, or nobody."""
        if not presented:
            return None
        if hmac.compare_digest(presented.encode(), self.token.encode()):
            return OPERATOR
        tenant = self.tenants.resolve(presented)
        return Viewer(tenant.name) if tenant is not None else None

    def session_for(self, viewer: Viewer, now_s: float) -> str:
        payload = _b64(json.dumps({"tenant": viewer.tenant, "exp": int(now_s + SESSION_S)}))
        return f"{payload}.{self._sign(payload)}"

    def viewer_of_session(self, cookie: str | None, now_s: float) -> Viewer | None:
        """The viewer of a session cookie this token signed and that has not expired."""
        payload, _, signature = (cookie or "").partition(".")
        if not payload or not hmac.compare_digest(signature.encode(), self._sign(payload).encode()):
            return None
        try:
            body = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        except ValueError:
            return None
        if not isinstance(body, dict) or float(body.get("exp", 0)) <= now_s:
            return None
        return Viewer(tenant=body.get("tenant"))

    def _sign(self, payload: str) -> str:
        key = hashlib.sha256(b"stepline dashboard session\0" + self.token.encode()).digest()
        return hmac.new(key, payload.encode(), hashlib.sha256).hexdigest()


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


_access_lock = threading.Lock()


def dashboard_access(request: Request) -> DashboardAccess:
    """The access rules of the app's context, built on first use (which writes the token file
    if one is needed)."""
    ctx = api_context(request)
    with _access_lock:
        built: tuple[ApiContext, DashboardAccess] | None = getattr(
            request.app.state, "dashboard_access", None)
        if built is None or built[0] is not ctx:
            built = (ctx, DashboardAccess.from_settings(ctx.settings, ctx.tenants))
            request.app.state.dashboard_access = built
    return built[1]


Access = Annotated[DashboardAccess, Depends(dashboard_access)]


def dashboard_viewer(
    access: Access,
    bearer: HTTPAuthorizationCredentials | None = Security(_bearer),
    header_key: str | None = Security(_header),
    session: str | None = Security(_session),
) -> Viewer:
    """The viewer of a request: its key or token if it sends one, else its session, else 401."""
    key = header_key or (bearer.credentials if bearer is not None else None)
    viewer = access.viewer_of(key) if key else access.viewer_of_session(session, time.time())
    if viewer is None:
        raise HTTPException(401, UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})
    return viewer


class DashboardData(BaseModel):
    """What the dashboard draws, read at one instant."""

    viewer: str = Field(description="'operator' (the read-only token) or 'tenant <name>'.")
    stats: LiveStatsView = Field(description="Exactly what GET /v1/stats answers this viewer.")
    slo_targets_s: dict[str, float] = Field(description="Each class's latency target.")
    timeline: Timeline


@router.get("/v1/dashboard/data", response_model=DashboardData,
            summary="The dashboard's figures: /v1/stats plus the worker timeline")
def dashboard_data(
    ctx: Ctx, viewer: Annotated[Viewer, Depends(dashboard_viewer)],
    timeline_s: Annotated[float, Query(ge=5, le=900, description="Timeline length.")] = 60.0,
) -> DashboardData:
    now_s = time.time()
    return DashboardData(
        viewer="operator" if viewer.tenant is None else f"tenant {viewer.tenant}",
        stats=live_stats(ctx.reads, ctx.settings, viewer, now_s),
        slo_targets_s={name: c.target_s for name, c in ctx.settings.scheduler.slo_classes.items()},
        timeline=read_timeline(ctx.reads, viewer, now_s - timeline_s, now_s),
    )


@router.get("/dashboard", response_class=HTMLResponse,
            responses={303: {"description": "A token was exchanged for a session cookie."},
                       401: {"description": "The sign-in page: no session, or a bad token."}},
            summary="The live SLO dashboard (a browser page)")
def dashboard(
    request: Request, access: Access, session: str | None = Security(_session),
    token: Annotated[str | None, Query(description="A token to exchange for a session.")] = None,
) -> Response:
    now_s = time.time()
    if token is not None:
        viewer = access.viewer_of(token.strip())
        if viewer is None:
            return _sign_in_page("That token is neither the dashboard token nor an API key.")
        response = RedirectResponse("/dashboard", status_code=303, headers=PAGE_HEADERS)
        response.set_cookie(COOKIE, access.session_for(viewer, now_s), max_age=SESSION_S,
                            httponly=True, samesite="lax", path="/",
                            secure=request.url.scheme == "https")
        return response
    if access.viewer_of_session(session, now_s) is None:
        return _sign_in_page("")
    return HTMLResponse(_static_text("dashboard.html"), headers=PAGE_HEADERS)


@router.get("/dashboard/logout", include_in_schema=False)
def dashboard_logout() -> Response:
    response = RedirectResponse("/dashboard", status_code=303, headers=PAGE_HEADERS)
    response.delete_cookie(COOKIE, path="/")
    return response


@router.get("/dashboard/static/{name}", include_in_schema=False)
def dashboard_asset(name: str) -> Response:
    if name not in ASSETS:
        raise HTTPException(404, f"no dashboard asset {name!r}")
    path, media_type = ASSETS[name]
    return Response(_static_bytes(path), media_type=media_type,
                    headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"})


def _sign_in_page(message: str) -> HTMLResponse:
    page = _static_text("login.html").replace("{{message}}", html.escape(message))
    return HTMLResponse(page, status_code=401, headers=PAGE_HEADERS)


@cache
def _static_bytes(path: str) -> bytes:
    return (STATIC_DIR / path).read_bytes()


def _static_text(path: str) -> str:
    return _static_bytes(path).decode()
