"""Each tenant's measured worker-seconds and share of its band, as /v1/stats, the dashboard's
tenant table and /metrics read them from the fair-share ledger."""

from __future__ import annotations

import pytest

from app.api.stats import OPERATOR, Viewer, tenant_service
from scheduler.fairness import ServiceLedger

pytestmark = pytest.mark.timeout(30)


def _ledger() -> ServiceLedger:
    return ServiceLedger({("batch", "alice", "gold"): 30.0, ("batch", "alice", "standard"): 10.0,
                          ("batch", "bob", "standard"): 60.0,
                          ("realtime", "bob", "standard"): 0.0})


def test_the_operator_sees_every_tenants_seconds_summed_over_tiers_and_its_share_of_the_band(
        ) -> None:
    # given alice served 40 s over two tiers and bob 60 s in batch, bob nothing in realtime
    # when the operator reads the tenant table
    rows = tenant_service(_ledger(), OPERATOR)
    # then each (band, tenant) has its seconds and share; a band that ran nothing has none
    assert [(r.band, r.tenant, r.service_s, r.share) for r in rows] == [
        ("batch", "alice", 40.0, 0.4), ("batch", "bob", 60.0, 0.6),
        ("realtime", "bob", 0.0, None)]


def test_a_tenant_sees_only_its_own_rows_with_its_share_of_all_tenants_seconds() -> None:
    # given the same ledger
    # when alice reads it
    rows = tenant_service(_ledger(), Viewer(tenant="alice"))
    # then only her row, her share still of the whole band's seconds
    assert [(r.tenant, r.share) for r in rows] == [("alice", 0.4)]
