"""Tenant fair share within a band (``scheduler.fairness``): the order the counters give, picked
one job at a time as the tick's slots free, serves every backlogged tenant, keeps two backlogged
tenants' weighted service within a chunk of each other, and gives a tenant that joins late no
credit for the time it was away."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from scheduler.fairness import (
    ON_TIME,
    URGENT,
    FairJob,
    FairShareConfig,
    ServiceLedger,
    fair_keys,
    jain_index,
    join,
    urgency,
)

BAND = "interactive"
NAMES = ("realtime", "interactive", "batch")
CONFIG = FairShareConfig(enabled=True, weights={"gold": 2.0, "standard": 1.0})


def pick(ledger: ServiceLedger, backlog: dict[str, list[float]],
         tiers: dict[str, str]) -> str:
    """The tenant whose head job the fair order puts first (one slot frees)."""
    tenants = sorted(t for t, jobs in backlog.items() if jobs)
    jobs = [FairJob(1, t, CONFIG.weight(tiers[t]), ON_TIME, False, backlog[t][0], True)
            for t in tenants]
    keys = fair_keys(jobs, [(0.0, 0.0)] * len(jobs), ledger.virtual(CONFIG), NAMES)
    return tenants[min(range(len(jobs)), key=lambda k: (keys[k], k))]


def serve(ledger: ServiceLedger, backlog: dict[str, list[float]], tiers: dict[str, str],
          picks: int) -> tuple[ServiceLedger, list[str]]:
    order = []
    for _ in range(picks):
        tenant = pick(ledger, backlog, tiers)
        order.append(tenant)
        ledger = ledger.charged(BAND, tenant, tiers[tenant], backlog[tenant].pop(0))
    return ledger, order


costs = st.floats(0.01, 2.0)
backlogs = st.dictionaries(st.sampled_from("abcdef"), st.lists(costs, min_size=40, max_size=40),
                           min_size=2, max_size=6)


@settings(max_examples=60)
@given(backlogs, st.data())
def test_every_backlogged_tenant_is_served_within_a_bounded_number_of_picks(
        backlog: dict[str, list[float]], data: st.DataObject) -> None:
    # given tenants of either tier, all backlogged, with counters already apart by < a chunk
    tiers = {t: data.draw(st.sampled_from(("gold", "standard"))) for t in backlog}
    ledger = join(ServiceLedger(), [(BAND, t) for t in backlog], CONFIG).ledger
    # when the slots free one at a time
    _, order = serve(ledger, backlog, tiers, 30)
    # then no tenant waits more than (its chunk ÷ the smallest chunk) × weights picks per other
    # tenant: with chunks within 200× of one another and weights within 2×, 400 × (n − 1)
    bound = 400 * (len(backlog) - 1)
    for tenant in backlog:
        assert tenant in order[:bound + 1]


@settings(max_examples=60)
@given(backlogs, st.data())
def test_the_weighted_service_gap_of_backlogged_tenants_stays_within_the_largest_chunk(
        backlog: dict[str, list[float]], data: st.DataObject) -> None:
    # given backlogged tenants of either tier, joined together
    tiers = {t: data.draw(st.sampled_from(("gold", "standard"))) for t in backlog}
    ledger = join(ServiceLedger(), [(BAND, t) for t in backlog], CONFIG).ledger
    largest = max(c / CONFIG.weight(tiers[t]) for t, jobs in backlog.items() for c in jobs)
    for _ in range(30):
        # when one more slot is given by the fair order
        ledger, _ = serve(ledger, backlog, tiers, 1)
        # then any two counters differ by at most the largest weighted chunk
        counters = [ledger.virtual(CONFIG).get((BAND, t), 0.0) for t in backlog]
        assert max(counters) - min(counters) <= largest + 1e-9


@given(st.floats(0.0, 1e4), st.floats(0.0, 1e4), st.floats(0.0, 1e4))
def test_a_tenant_that_joins_late_gets_no_banked_credit(a_s: float, b_s: float,
                                                         c_s: float) -> None:
    # given tenants a and b busy in the band with measured service, c away with less or more
    ledger = ServiceLedger().charged(BAND, "a", "standard", a_s)
    ledger = ledger.charged(BAND, "b", "standard", b_s).charged(BAND, "c", "standard", c_s)
    ledger = join(ledger, [(BAND, "a"), (BAND, "b")], CONFIG).ledger
    # when c comes back
    joined = join(ledger, [(BAND, "a"), (BAND, "b"), (BAND, "c")], CONFIG)
    counters = joined.ledger.virtual(CONFIG)
    # then it starts no lower than the least of those who stayed, and loses none of its own
    assert counters[BAND, "c"] >= min(a_s, b_s) - 1e-9
    assert counters[BAND, "c"] >= c_s - 1e-9
    # and the tenants who stayed are not moved
    assert counters[BAND, "a"] == a_s and counters[BAND, "b"] == b_s


def test_a_tenant_joining_a_band_whose_tenants_all_left_joins_at_its_last_floor() -> None:
    # given a busy band whose least counter was 50, then idle
    ledger = ServiceLedger().charged(BAND, "a", "standard", 50.0)
    ledger = join(ledger, [(BAND, "a")], CONFIG).ledger
    ledger = join(ledger, [], CONFIG).ledger
    # when b, never served, arrives alone
    counters = join(ledger, [(BAND, "b")], CONFIG).ledger.virtual(CONFIG)
    # then it joins at 50, not at 0 with 50 seconds banked against a's return
    assert counters[BAND, "b"] == 50.0


def test_a_job_whose_slack_no_longer_covers_its_chunk_is_urgent_and_late_work_past_saving(
        ) -> None:
    assert urgency(0.05, 0.1, False) == URGENT
    assert urgency(0.5, 0.1, False) == ON_TIME
    assert urgency(-0.1, 0.1, False) > ON_TIME
    assert urgency(5.0, 0.1, True) > ON_TIME


def test_an_urgent_job_of_a_heavy_tenant_goes_before_the_fair_order() -> None:
    # given a heavy tenant with an urgent job and a light tenant with an on-time one
    ledger = ServiceLedger().charged(BAND, "heavy", "standard", 1000.0)
    jobs = [FairJob(1, "heavy", 1.0, URGENT, False, 0.1, True),
            FairJob(1, "light", 1.0, ON_TIME, False, 0.1, True)]
    # when they are ordered
    keys = fair_keys(jobs, [(0.0, 0.0)] * 2, ledger.virtual(CONFIG), NAMES)
    # then the deadline wins
    assert keys[0] < keys[1]


def test_on_equal_counters_the_warm_job_goes_first() -> None:
    jobs = [FairJob(1, "a", 1.0, ON_TIME, False, 0.1, False),
            FairJob(1, "b", 1.0, ON_TIME, False, 0.1, True)]
    keys = fair_keys(jobs, [(0.0, 0.0)] * 2, {}, NAMES)
    assert keys[1] < keys[0]


def test_jains_index_is_one_for_equal_shares_and_one_over_n_for_one_taker() -> None:
    assert jain_index([2.0, 2.0, 2.0]) == 1.0
    assert abs(jain_index([1.0, 0.0, 0.0, 0.0]) - 0.25) < 1e-12


class Arrivals(RuleBasedStateMachine):
    """Tenants come and go in one band; slots free one at a time; the counters follow."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = ServiceLedger()
        self.backlog: dict[str, list[float]] = {}
        self.tiers: dict[str, str] = {}

    def _join(self) -> None:
        before = self.ledger
        active = [(BAND, t) for t, jobs in self.backlog.items() if jobs]
        self.ledger = join(before, active, CONFIG).ledger
        staying = [before.virtual(CONFIG).get(k, 0.0) for k in active if k in before.active]
        for key in active:
            if key not in before.active and staying:
                # a newcomer starts no lower than the least of those who stayed
                assert self.ledger.virtual(CONFIG).get(key, 0.0) >= min(staying) - 1e-9

    @rule(tenant=st.sampled_from("abcd"), tier=st.sampled_from(("gold", "standard")),
          jobs=st.lists(costs, min_size=1, max_size=5))
    def arrive(self, tenant: str, tier: str, jobs: list[float]) -> None:
        self.tiers.setdefault(tenant, tier)
        self.backlog.setdefault(tenant, []).extend(jobs)
        self._join()

    @precondition(lambda self: any(self.backlog.values()))
    @rule()
    def complete(self) -> None:
        tenant = pick(self.ledger, self.backlog, self.tiers)
        self.ledger = self.ledger.charged(BAND, tenant, self.tiers[tenant],
                                          self.backlog[tenant].pop(0))
        self._join()

    @invariant()
    def backlogged_tenants_stay_within_a_chunk_of_the_band_floor(self) -> None:
        active = [t for t, jobs in self.backlog.items() if jobs]
        if len(active) < 2:
            return
        counters = self.ledger.virtual(CONFIG)
        low = min(counters.get((BAND, t), 0.0) for t in active)
        for t in active:
            # counters grow only by the pick of the least one, a newcomer joins no lower than
            # the least, so the band's least never falls: no backlogged tenant is more than
            # the largest weighted chunk (2 s at weight 1) above it
            assert counters.get((BAND, t), 0.0) - low <= 2.0 + 1e-9

TestArrivals = Arrivals.TestCase
TestArrivals.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


def test_the_metrics_show_each_tenants_seconds_and_share_of_its_band() -> None:
    from app.api.metrics import fair_share_metrics

    ledger = ServiceLedger().charged(BAND, "a", "gold", 3.0).charged(BAND, "b", "standard", 1.0)
    seconds, share = fair_share_metrics(ledger)
    assert {s.labels["tenant"]: s.value for s in seconds.samples} == {"a": 3.0, "b": 1.0}
    assert {s.labels["tenant"]: s.value for s in share.samples} == {"a": 0.75, "b": 0.25}


def test_a_joiner_is_lifted_to_the_stayers_counter_plus_their_in_flight_charges() -> None:
    # given alice active with 10 s committed and 4 s of chunks placed but not committed yet
    ledger = ServiceLedger({(BAND, "alice", "standard"): 10.0},
                           active=frozenset({(BAND, "alice")}))
    in_flight = {(BAND, "alice"): 4.0}
    # when bob becomes active in the band
    joined = join(ledger, [(BAND, "alice"), (BAND, "bob")], CONFIG, in_flight)
    # then bob joins at alice's standing (14 s), not her committed counter (10 s): his first
    # start tag is level with her next waiting job's, not ahead of her placed chunks
    assert joined.lifts == {(BAND, "bob"): 14.0}
    assert joined.ledger.virtual(CONFIG)[BAND, "bob"] == 14.0
    assert joined.ledger.floor[BAND] == 14.0


@settings(max_examples=200)
@given(st.dictionaries(st.sampled_from("abcd"), st.tuples(
    st.floats(0, 100), st.floats(0, 50), st.booleans()), min_size=1),
    st.floats(0, 50))
def test_a_joiner_never_stands_below_the_least_standing_of_those_who_stayed(
        tenants: dict[str, tuple[float, float, bool]], joiner_flight: float) -> None:
    # given tenants with committed seconds, in-flight charges and whether they stayed
    service = {(BAND, t, "standard"): s for t, (s, _, _) in tenants.items()}
    stayed = frozenset((BAND, t) for t, (_, _, kept) in tenants.items() if kept)
    in_flight = {(BAND, t): f for t, (_, f, _) in tenants.items()}
    in_flight[BAND, "new"] = joiner_flight
    ledger = ServiceLedger(service, active=stayed)
    # when a new tenant joins beside them
    joined = join(ledger, [*((BAND, t) for t in tenants), (BAND, "new")], CONFIG, in_flight)
    # then its standing (counter + in-flight) is at least the least standing of the stayers
    virtual = joined.ledger.virtual(CONFIG)
    standings = [virtual.get(key, 0.0) + in_flight[key] for key in stayed]
    if standings:
        assert virtual.get((BAND, "new"), 0.0) + joiner_flight >= min(standings) - 1e-9
    # and the stayers are not moved
    assert all(virtual.get(key, 0.0) == ledger.virtual(CONFIG).get(key, 0.0) for key in stayed)


@settings(max_examples=200)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.sampled_from((URGENT, ON_TIME)),
                          st.floats(0.01, 10.0)), min_size=2, max_size=20),
       st.dictionaries(st.sampled_from("abc"), st.floats(0, 1e4)))
def test_deadlines_win_an_urgent_job_goes_before_every_on_time_job_whatever_the_counters(
        jobs: list[tuple[str, int, float]], counters: dict[str, float]) -> None:
    # given jobs of one band, some urgent (slack below their next chunk), tenants at any counter
    fair = [FairJob(1, t, 1.0, u, False, chunk, True) for t, u, chunk in jobs]
    # when the fair keys are built
    keys = fair_keys(fair, [(0.0, float(k)) for k in range(len(fair))],
                     {(BAND, t): v for t, v in counters.items()}, NAMES)
    # then every urgent job's key is smaller than every on-time job's, however far ahead
    # its tenant's counter is
    urgent = [k for k, job in zip(keys, fair, strict=True) if job.urgency == URGENT]
    on_time = [k for k, job in zip(keys, fair, strict=True) if job.urgency == ON_TIME]
    assert all(u < o for u in urgent for o in on_time)
