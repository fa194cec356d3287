"""The model residency: budgets never exceeded, models in use never evicted, the cost-aware
policy against LRU, measured bytes, and a rebuilt model bit-identical to the one evicted."""

from __future__ import annotations

import threading
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.heartbeat import Heartbeat
from workers.diffusion.components import (
    DIFFUSION_RESIDENT,
    build_components,
    build_host_components,
    component_key,
)
from workers.diffusion.recipes import diffusion_recipe
from workers.residency import (
    ModelMemoryError,
    ModelResidency,
    Resident,
    module_tensors,
    tensor_bytes,
)

pytestmark = pytest.mark.timeout(120)

SIZES = {"a": 300, "b": 500, "c": 200, "d": 700, "e": 400}


@dataclass
class FakeModel:
    """A model of ``size`` bytes (one uint8 tensor), and whether it was released."""

    tensor: torch.Tensor
    released: list[bool] = field(default_factory=lambda: [False])


FAKE = Resident(tensors=lambda m: [m.tensor], to_host=lambda m: None, to_device=lambda m: None,
                release=lambda m: m.released.__setitem__(0, True))


def _build(key: str) -> FakeModel:
    return FakeModel(torch.zeros(SIZES[key], dtype=torch.uint8))


def test_bytes_are_measured_per_storage_so_tied_weights_count_once() -> None:
    shared = torch.zeros(10, 4)  # 160 bytes
    lin = torch.nn.Linear(4, 10, bias=False)
    lin.weight = torch.nn.Parameter(shared)
    other = torch.nn.Linear(4, 10, bias=False)
    other.weight = lin.weight  # tied
    other.register_buffer("scale", torch.ones(3, dtype=torch.float64))  # 24 bytes
    assert tensor_bytes(module_tensors([lin, other, None])) == 160 + 24
    assert tensor_bytes([shared, shared[:5]]) == 160


OPS = st.lists(st.tuples(st.sampled_from(["acquire", "pin", "unpin", "stage"]),
                         st.sampled_from(sorted(SIZES))), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, budget=st.integers(700, 2000), host=st.sampled_from([0, 600, None]),
       policy=st.sampled_from(["cost", "lru"]))
def test_any_sequence_keeps_both_budgets_and_never_evicts_a_pinned_model(
    ops: list[tuple[str, str]], budget: int, host: int | None, policy: str
) -> None:
    r = ModelResidency(budget, host, policy)  # type: ignore[arg-type]
    pins: dict[str, list[ExitStack]] = {k: [] for k in SIZES}
    for op, key in ops:
        pinned_before = {k for k in SIZES if pins[k] and r.tier_of(k) == "device"}
        if op == "acquire":
            try:
                model = r.acquire(key, lambda key=key: _build(key), FAKE)  # type: ignore[misc]
                assert model.tensor.numel() == SIZES[key]
                assert r.tier_of(key) == "device"
            except ModelMemoryError:
                # refused only when the pinned models leave it no room
                held = sum(SIZES[k] for k in pinned_before if k != key)
                assert held + SIZES[key] > budget
        elif op == "stage":  # read into the host tier ahead of its jobs
            held_before = r.tier_of(key)
            staged = r.stage(key, lambda key=key: _build(key), FAKE)  # type: ignore[misc]
            assert staged == (held_before == "disk" and host != 0
                              and (host is None or SIZES[key] <= host))
            assert r.tier_of(key) == ("host" if staged else held_before)
        elif op == "pin":
            stack = ExitStack()
            stack.enter_context(r.pinned(key))
            pins[key].append(stack)
        elif pins[key]:
            pins[key].pop().close()
        assert r.tier_bytes("device") <= budget
        assert host is None or r.tier_bytes("host") <= host
        for k in pinned_before:  # a pinned model on the device stays there
            assert r.tier_of(k) == "device"
        summary = r.summary()
        assert sum(summary["device"].values()) == r.tier_bytes("device")
        assert summary["peak_device_bytes"] <= budget


def test_a_model_acquired_in_use_is_pinned_until_the_bracket_closes() -> None:
    r = ModelResidency(budget_bytes=800)
    with r.in_use():
        r.acquire("a", lambda: _build("a"), FAKE)  # 300
        r.acquire("b", lambda: _build("b"), FAKE)  # 500: both fit
        assert r.is_pinned("a") and r.is_pinned("b")
        with pytest.raises(ModelMemoryError, match="budget of 800 bytes"):
            r.acquire("c", lambda: _build("c"), FAKE)  # 200 more: nothing may go
        assert r.tier_of("c") == "disk"
    assert not r.is_pinned("a")
    r.acquire("c", lambda: _build("c"), FAKE)
    assert r.tier_bytes("device") <= 800
    assert r.summary()["evictions"]["disk"] == 1


def test_a_model_larger_than_the_budget_is_refused_with_its_size() -> None:
    r = ModelResidency(budget_bytes=400)
    with pytest.raises(ModelMemoryError, match="model d"):
        r.acquire("d", lambda: _build("d"), FAKE)
    assert r.tier_bytes("device") == 0


def test_an_evicted_model_goes_to_host_memory_and_returns_from_there() -> None:
    r = ModelResidency(budget_bytes=800, host_budget_bytes=500, policy="lru")
    first = r.acquire("a", lambda: _build("a"), FAKE)
    r.acquire("b", lambda: _build("b"), FAKE)
    r.acquire("c", lambda: _build("c"), FAKE)  # a (least recently used) falls to the host
    assert r.tier_of("a") == "host" and r.tier_bytes("device") <= 800
    again = r.acquire("a", lambda: _build("a"), FAKE)
    assert again is first  # moved back, not rebuilt
    summary = r.summary()
    assert summary["loads"] == {"disk": 3, "host": 1}
    assert [load["tier"] for load in summary["recent"]] == ["disk", "disk", "disk", "host"]
    assert summary["recent"][-1]["bytes"] == SIZES["a"]


def test_a_staged_model_waits_in_host_memory_and_its_first_use_moves_it_back() -> None:
    r = ModelResidency(budget_bytes=800, host_budget_bytes=500)
    r.acquire("b", lambda: _build("b"), FAKE)  # the device holds b
    built: list[str] = []

    def build_a() -> FakeModel:
        built.append("a")
        return _build("a")

    assert r.stage("a", build_a, FAKE)
    assert r.tier_of("a") == "host" and r.tier_of("b") == "device"  # the device untouched
    assert not r.stage("a", build_a, FAKE)  # held already: nothing read again
    r.acquire("a", build_a, FAKE)
    assert built == ["a"] and r.tier_of("a") == "device"  # moved back, not built again
    summary = r.summary()
    assert summary["staged"] == 1 and summary["loads"] == {"disk": 1, "host": 1}
    assert [load["tier"] for load in summary["recent"]] == ["disk", "stage", "host"]


def test_staging_needs_a_host_tier_with_room_and_a_failed_read_holds_nothing() -> None:
    none = ModelResidency(budget_bytes=800, host_budget_bytes=0)
    assert not none.stage("a", lambda: _build("a"), FAKE)
    assert none.tier_of("a") == "disk"
    small = ModelResidency(budget_bytes=800, host_budget_bytes=250)
    assert not small.stage("a", lambda: _build("a"), FAKE)  # 300 bytes: does not fit
    assert small.tier_of("a") == "disk" and small.tier_bytes("host") == 0

    def broken() -> FakeModel:
        raise OSError("weights unreadable")

    assert not small.stage("c", broken, FAKE)
    assert small.tier_of("c") == "disk" and small.summary()["staging"] == []
    full = ModelResidency(budget_bytes=800, host_budget_bytes=700, policy="lru")
    assert full.stage("a", lambda: _build("a"), FAKE) and full.stage("e", lambda: _build("e"),
                                                                     FAKE)
    assert full.stage("c", lambda: _build("c"), FAKE)  # 900 bytes: the oldest staged goes
    assert full.tier_of("a") == "disk" and full.tier_bytes("host") <= 700


def test_a_chunk_that_needs_a_model_being_staged_waits_for_that_read() -> None:
    r = ModelResidency(budget_bytes=800, host_budget_bytes=None)
    reading, release = threading.Event(), threading.Event()
    builds: list[str] = []

    def slow_read() -> FakeModel:
        builds.append("stage")
        reading.set()
        release.wait(10)
        return _build("a")

    stager = threading.Thread(target=r.stage, args=("a", slow_read, FAKE))
    stager.start()
    assert reading.wait(10)
    assert r.summary()["staging"] == ["a"]
    got: list[FakeModel] = []
    chunk = threading.Thread(target=lambda: got.append(
        r.acquire("a", lambda: builds.append("chunk") or _build("a"), FAKE)))
    chunk.start()
    chunk.join(0.2)
    assert chunk.is_alive()  # waits for the read under way instead of starting its own
    release.set()
    stager.join(10)
    chunk.join(10)
    assert builds == ["stage"] and got and r.tier_of("a") == "device"
    assert r.summary()["loads"]["host"] == 1


def test_a_dropped_model_is_released_and_forget_drops_an_owners_models() -> None:
    r = ModelResidency(budget_bytes=700)
    a = r.acquire("x:a", lambda: _build("a"), FAKE)
    r.acquire("x:b", lambda: _build("b"), FAKE)  # a goes to disk: released
    assert a.released[0] and r.tier_of("x:a") == "disk"
    r.forget("x:")
    assert r.holding() == {}


def _load_seconds(policy: str) -> float:
    """Load seconds of a skewed sequence: one expensive model (10 s) every third acquisition,
    three cheap ones (0.1 s) cycling between, a budget of two equal-sized models."""
    clock = [0.0]
    r = ModelResidency(budget_bytes=2 * SIZES["a"], policy=policy,  # type: ignore[arg-type]
                       clock_s=lambda: clock[0], timer_s=lambda: clock[0])
    cheap = ["b", "c", "e"]

    def build(cost_s: float) -> FakeModel:
        clock[0] += cost_s  # the build takes this long on the residency's timer
        return FakeModel(torch.zeros(SIZES["a"], dtype=torch.uint8))

    for i in range(60):
        key = "big" if i % 3 == 0 else cheap[i % len(cheap)]
        cost_s = 10.0 if key == "big" else 0.1
        r.acquire(key, lambda c=cost_s: build(c), FAKE)  # type: ignore[misc]
        clock[0] += 1.0  # time between acquisitions
    return float(sum(r.summary()["load_s"].values()))


def test_the_cost_aware_policy_reloads_less_than_lru_on_a_skewed_sequence() -> None:
    lru, cost = _load_seconds("lru"), _load_seconds("cost")
    assert cost < lru / 5, (cost, lru)


def test_an_evicted_diffusion_model_is_rebuilt_bit_identical() -> None:
    r = ModelResidency()
    recipe = diffusion_recipe("dit-tiny")
    key = component_key(recipe)
    first = r.acquire(key, lambda: build_components(recipe), DIFFUSION_RESIDENT)
    size = r.tier_bytes("device")
    expected = sum(t.numel() * t.element_size() for t in module_tensors(
        [first.transformer, first.vae, first.text_encoder]))
    assert size == expected > 0
    before = {name: t.clone() for name, t in first.transformer.state_dict().items()}
    r.budget_bytes = size  # room for one model of this size: the next model evicts it
    other = diffusion_recipe("pixart-tiny")
    with suppress(ModelMemoryError):  # refused too if larger than the budget, after evicting
        r.acquire(component_key(other), lambda: build_components(other), DIFFUSION_RESIDENT)
    assert r.tier_of(key) == "disk"
    r.budget_bytes = None
    again = r.acquire(key, lambda: build_components(recipe), DIFFUSION_RESIDENT)
    assert again is not first
    after = again.transformer.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert [load["tier"] for load in r.summary()["recent"] if load["model"] == key] == ["disk"] * 2


def test_a_staged_diffusion_model_is_built_in_host_memory_and_runs_bit_identical() -> None:
    r = ModelResidency(host_budget_bytes=None)
    recipe = diffusion_recipe("dit-tiny")
    key = component_key(recipe)
    assert r.stage(key, lambda: build_host_components(recipe), DIFFUSION_RESIDENT)
    assert r.tier_of(key) == "host" and r.tier_bytes("device") == 0
    staged = r.acquire(key, lambda: build_components(recipe), DIFFUSION_RESIDENT)
    assert r.summary()["loads"] == {"disk": 0, "host": 1}  # moved back, not built again
    built = build_components(recipe)
    assert staged.device == built.device
    for mine, theirs in ((staged.transformer, built.transformer), (staged.vae, built.vae)):
        a, b = mine.state_dict(), theirs.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_the_heartbeat_carries_the_residency_both_ways() -> None:
    r = ModelResidency(budget_bytes=900, host_budget_bytes=None)
    r.acquire("a", lambda: _build("a"), FAKE)
    r.acquire("b", lambda: _build("b"), FAKE)
    r.acquire("c", lambda: _build("c"), FAKE)
    summary = r.summary()
    beat = Heartbeat(name="w1@h", residency=summary)
    back = Heartbeat.decode(beat.encode())
    assert back.residency == summary
    assert back.resident_bytes("device") == r.tier_bytes("device") <= 900
    assert back.resident_bytes("host") == r.tier_bytes("host") > 0
    assert "residency" not in Heartbeat(name="w").encode()


def test_metrics_show_each_workers_resident_bytes_and_loads() -> None:
    from app.api.metrics import residency_metrics

    r = ModelResidency(budget_bytes=900, host_budget_bytes=500, policy="lru")
    for key in ("a", "b", "c"):
        r.acquire(key, lambda key=key: _build(key), FAKE)  # type: ignore[misc]
    assert r.stage("e", lambda: _build("e"), FAKE)  # a ahead of it in host memory goes
    beats = {"w1@h": Heartbeat(name="w1@h", residency=r.summary()), "w2@h": Heartbeat("w2@h")}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for metric in residency_metrics(beats) for s in metric.samples}
    assert samples[("stepline_worker_resident_bytes", (("tier", "device"), ("worker", "w1@h")))
                   ] == r.tier_bytes("device") == SIZES["b"] + SIZES["c"]
    assert samples[("stepline_worker_model_loads_total",
                    (("source", "disk"), ("worker", "w1@h")))] == 3
    assert ("stepline_worker_model_load_seconds_total",
            (("source", "disk"), ("worker", "w1@h"))) in samples
    assert samples[("stepline_worker_model_loads_total",
                    (("source", "stage"), ("worker", "w1@h")))] == 1
    assert samples[("stepline_worker_resident_bytes", (("tier", "host"), ("worker", "w1@h")))
                   ] == SIZES["e"]
    assert not any("w2@h" in dict(labels).values() for _, labels in samples)
    assert samples[("stepline_worker_loading", (("worker", "w1@h"),))] == 0.0
    with r.loading("c", 1.0):  # a chunk waiting for a load now
        busy = {"w1@h": Heartbeat(name="w1@h", residency=r.summary())}
        assert [s.value for m in residency_metrics(busy) for s in m.samples
                if s.name == "stepline_worker_loading"] == [1.0]


# a load a chunk waits for, announced ---------------------------------------------------------
def test_a_load_is_announced_while_it_runs_with_its_expected_seconds_and_its_end_kept() -> None:
    wall = [100.0]
    seen: list[dict[str, object] | None] = []
    r = ModelResidency(budget_bytes=800, host_budget_bytes=500, policy="lru",
                       wall_s=lambda: wall[0])

    def build(key: str) -> FakeModel:
        seen.append(r.summary().get("loading"))  # what a heartbeat written now would say
        wall[0] += 2.0
        return _build(key)

    told: list[object] = []
    r.on_load = lambda: told.append(r.summary().get("loading"))
    r.acquire("a", lambda: build("a"), FAKE, expect_s={"disk": 2.5})
    assert seen == [{"model": "a", "since": 100.0, "expected_s": 2.5, "from": "disk"}]
    assert told == [seen[0], None]  # told as it began and as it ended
    summary = r.summary()
    assert "loading" not in summary and summary["loaded_at"] == 102.0
    # no expectation given: its last measured load from the tier it comes from
    r.acquire("b", lambda: _build("b"), FAKE)
    r.acquire("c", lambda: _build("c"), FAKE)  # a falls to host memory
    # never moved back from host memory, nor any model: not measured
    assert r.expected_load_s("a") == 0.0
    assert r.expected_load_s("a", {"host": 0.7}) == 0.7
    assert r.expected_load_s("c") == 0.0  # on the device
    # a resident model's acquisition announces nothing
    told.clear()
    r.acquire("c", lambda: _build("c"), FAKE)
    assert told == []


def test_a_runners_load_of_base_and_adapters_is_one_announcement() -> None:
    r = ModelResidency(budget_bytes=800, wall_s=lambda: 5.0)
    told: list[object] = []
    r.on_load = lambda: told.append(r.summary().get("loading"))
    with r.loading("a", 3.0):  # the runner's: base and adapters
        r.acquire("a", lambda: _build("a"), FAKE, expect_s={"disk": 1.0})
        assert r.summary()["loading"] == {"model": "a", "since": 5.0, "expected_s": 3.0}
    assert told == [{"model": "a", "since": 5.0, "expected_s": 3.0}, None]
    assert r.peek("a") is not None and r.peek("zz") is None


def test_the_seconds_of_announced_loads_add_up() -> None:
    """What a worker subtracts from a chunk's time: only the outermost announcement counts."""
    timer = [0.0]
    r = ModelResidency(budget_bytes=800, timer_s=lambda: timer[0])

    def build() -> FakeModel:
        timer[0] += 2.0
        return _build("a")

    with r.loading("a", None):
        r.acquire("a", build, FAKE)  # its own announcement is inside the runner's
        timer[0] += 0.5  # an adapter
    assert r.load_wait_s == 2.5
    r.acquire("a", build, FAKE)  # resident: no load
    assert r.load_wait_s == 2.5


def test_a_load_never_measured_is_expected_as_long_as_this_workers_others_from_its_tier() -> None:
    timer, wall = [0.0], [0.0]
    r = ModelResidency(budget_bytes=2000, timer_s=lambda: timer[0], wall_s=lambda: wall[0])

    def build(key: str, seconds: float) -> FakeModel:
        timer[0] += seconds
        return _build(key)

    r.acquire("a", lambda: build("a", 1.0), FAKE)
    r.acquire("b", lambda: build("b", 3.0), FAKE)
    seen: list[object] = []
    r.acquire("c", lambda: seen.append(r.summary()["loading"]) or build("c", 1.0), FAKE)
    assert seen == [{"model": "c", "since": 0.0, "expected_s": 2.0, "from": "disk"}]


@pytest.mark.parametrize("model", ["wan22-tiny", "wan22-i2v-tiny"])
def test_both_wan22_experts_are_counted_in_the_models_bytes_and_move_with_it(model: str) -> None:
    # given a residency with a host tier and a two-expert Wan 2.2 recipe (text- or image-to-video)
    r = ModelResidency(host_budget_bytes=None)
    recipe = diffusion_recipe(model)
    key = component_key(recipe)
    # when the model is acquired, then evicted to host memory by a budget too small for it
    c = r.acquire(key, lambda: build_components(recipe), DIFFUSION_RESIDENT)
    expert_bytes = tensor_bytes(module_tensors([c.transformer_2]))
    rest = tensor_bytes(module_tensors([c.transformer, c.vae, c.text_encoder]))
    device_bytes = r.tier_bytes("device")
    r.budget_bytes = 1
    r.remeasure()
    # then its bytes are all four modules', the low-noise expert's among them, and the whole
    # model (both experts) went to host memory together
    assert expert_bytes > 0 and device_bytes == rest + expert_bytes
    assert r.tier_of(key) == "host" and r.tier_bytes("host") == device_bytes
    assert r.summary()["host"] == {key: rest + expert_bytes}


def test_each_of_sd35s_three_text_encoders_is_counted_in_the_models_bytes() -> None:
    # given a residency and the SD 3.5 recipe (two CLIPs and a T5 beside the MMDiT and the VAE)
    r = ModelResidency(host_budget_bytes=None)
    recipe = diffusion_recipe("sd35-tiny")
    key = component_key(recipe)
    # when the model is acquired, then evicted to host memory by a budget too small for it
    c = r.acquire(key, lambda: build_components(recipe), DIFFUSION_RESIDENT)
    encoders = [c.text_encoder, c.text_encoder_2, c.text_encoder_3]
    each = [tensor_bytes(module_tensors([encoder])) for encoder in encoders]
    device_bytes = r.tier_bytes("device")
    r.budget_bytes = 1
    r.remeasure()
    # then its bytes are all five modules', each encoder's among them, moved to host together
    assert all(b > 0 for b in each)
    assert device_bytes == tensor_bytes(module_tensors([c.transformer, c.vae])) + sum(each)
    assert r.tier_of(key) == "host" and r.summary()["host"] == {key: device_bytes}


def test_a_text_encoder_two_recipes_name_alike_is_held_once_and_outlives_either_model() -> None:
    # given a residency and wan-tiny and wan22-tiny, whose UMT5 has one class, config and seed
    from workers.diffusion.components import load_components, part_keys
    r = ModelResidency()
    wan, wan22 = diffusion_recipe("wan-tiny"), diffusion_recipe("wan22-tiny")
    # when both models are loaded
    a, b = load_components(wan, residency=r), load_components(wan22, residency=r)
    # then the encoder is one item, counted once, the same modules as a fresh build
    shared = part_keys(wan)["text_encoder"]
    assert shared == part_keys(wan22)["text_encoder"] and a.text_encoder is b.text_encoder
    device = r.summary()["device"]
    assert sum(k.startswith("text_encoder:") for k in device) == 1
    assert device[shared] == tensor_bytes(module_tensors([a.text_encoder]))
    fresh = build_components(wan22).text_encoder.state_dict()
    assert all(torch.equal(t, fresh[n]) for n, t in a.text_encoder.state_dict().items())
    # and the second expert is an item of its own
    assert device[part_keys(wan22)["transformer_2"]] == tensor_bytes(
        module_tensors([b.transformer_2]))
    # when one model is dropped, then the encoder stays for the other
    r.forget(component_key(wan))
    assert r.tier_of(component_key(wan)) == "disk" and r.tier_of(shared) == "device"
