"""Dashboard sign-in: which tokens open it, and the session cookie they are traded for."""

from __future__ import annotations

import pytest

from app.api.dashboard import SESSION_S, DashboardAccess
from app.api.stats import OPERATOR, Viewer
from app.tenants import TenantDirectory
from tasks.settings.api import ApiKeySettings

pytestmark = pytest.mark.timeout(30)

TOKEN = "sld-read-only-token-0123456789"
KEY = "acme-key-0123456789abcdef"


def access(token: str = TOKEN) -> DashboardAccess:
    return DashboardAccess(token, TenantDirectory([ApiKeySettings(key=KEY, tenant="acme")]))


def test_the_read_only_token_is_the_operator_and_an_api_key_its_tenant() -> None:
    assert access().viewer_of(TOKEN) == OPERATOR
    assert access().viewer_of(KEY) == Viewer("acme")
    assert access().viewer_of("nope") is None and access().viewer_of("") is None


def test_a_session_holds_its_viewer_until_it_expires() -> None:
    # given sessions issued at t=1000
    operator = access().session_for(OPERATOR, now_s=1000.0)
    tenant = access().session_for(Viewer("acme"), now_s=1000.0)

    # then each names its viewer while it lasts, and nobody after
    assert access().viewer_of_session(operator, now_s=1000.0 + SESSION_S - 1) == OPERATOR
    assert access().viewer_of_session(tenant, now_s=1001.0) == Viewer("acme")
    assert access().viewer_of_session(tenant, now_s=1000.0 + SESSION_S) is None


def test_a_tampered_or_foreign_session_opens_nothing() -> None:
    session = access().session_for(Viewer("acme"), now_s=1000.0)
    payload, _, signature = session.partition(".")
    forged = access().session_for(OPERATOR, now_s=1000.0).partition(".")[0] + "." + signature
    assert access().viewer_of_session(forged, now_s=1001.0) is None
    assert access().viewer_of_session(payload + ".", now_s=1001.0) is None
    assert access().viewer_of_session(payload + ".é" + signature[2:], now_s=1001.0) is None
    assert access().viewer_of_session(None, now_s=1001.0) is None
    # and a new dashboard token ends every session the old one signed
    assert access("sld-another-token-0123456789").viewer_of_session(session, 1001.0) is None
