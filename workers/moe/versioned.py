"""Expert weights per version, side by side: the live version, a candidate taking part of the
traffic, and the kept ones for rollback, each in host memory; a device cache for each version
that serves jobs. The forward passes read the *active* version's cache, chosen per job.

A version file is safetensors with ``layers.<i>.gate_up_proj`` ``[E, 2I, H]`` and
``layers.<i>.down_proj`` ``[E, H, I]``; layers it leaves out share the live version's tensors.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Collection, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from workers.errors import ExpertVersionError
from workers.moe.expert_cache import CacheConfig, ExpertCache, HostExperts

BASE_VERSION = "base"
"""The version of the weights a model was built or loaded with."""
_KEY = re.compile(r"^layers\.(\d+)\.(gate_up_proj|down_proj)$")
VERSION_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class VersionedExperts:
    """One model's expert versions on one worker. Thread-safe: the worker's heartbeat thread
    may preload a version while a chunk runs."""

    def __init__(self, base: HostExperts, config: CacheConfig, device: str = "cpu",
                 min_slots: int = 1) -> None:
        self.config = config
        self.device = device
        self.min_slots = min_slots
        self._hosts = {BASE_VERSION: base}
        self._caches = {BASE_VERSION: ExpertCache(base, config, device, min_slots=min_slots)}
        self.active_version = BASE_VERSION
        self.live_version = BASE_VERSION
        """The version a job that names none runs on."""
        self._lock = threading.RLock()

    @property
    def active(self) -> ExpertCache:
        """The cache forward passes use now."""
        return self._caches[self.active_version]

    @property
    def versions(self) -> list[str]:
        return sorted(self._hosts)

    def has(self, name: str) -> bool:
        return name in self._hosts

    def host(self, name: str) -> HostExperts:
        """The host-memory weights of version ``name``."""
        with self._lock:
            return self._hosts[name]

    def add(self, name: str, host: HostExperts) -> None:
        """Hold ``host`` as version ``name`` beside the others (same shapes as the live one)."""
        if not VERSION_NAME.match(name):
            raise ExpertVersionError(f"version name {name!r}: use 1-64 letters, digits, . _ -")
        _check_compatible(self._hosts[self.live_version], host, name)
        with self._lock:
            self._hosts[name] = host
            stale = self._caches.pop(name, None)  # a reloaded version starts with a fresh cache
        if stale is not None:
            stale.close()

    def load_file(self, name: str, path: Path) -> None:
        """Read a version file and hold it as ``name``."""
        with self._lock:
            like = self._hosts[self.live_version]
        self.add(name, read_expert_file(path, like))

    def use(self, name: str) -> ExpertCache:
        """Make ``name`` the active version (its device cache built and warmed on first use)."""
        with self._lock:
            if name not in self._hosts:
                raise ExpertVersionError(
                    f"expert version {name!r} is not loaded on this worker (loaded: "
                    f"{', '.join(self.versions)}); start it with `stepline experts update`"
                )
            self.prepare(name)
            self.active_version = name
            return self._caches[name]

    def prepare(self, name: str) -> None:
        """Build ``name``'s device cache holding what the live version's holds (the router is
        shared, so are the popular experts): a new version must not be judged on a cold cache."""
        with self._lock:
            if name in self._caches:
                return
            live = self._caches.get(self.live_version, self.active)
            cache = ExpertCache(self._hosts[name], self.config, self.device,
                                min_slots=self.min_slots)
            cache.tick(live.now_s)
            cache.mirror(live)
            self._caches[name] = cache

    def retain(self, hosts: Collection[str], caches: Collection[str]) -> list[str]:
        """Keep the weights of ``hosts`` and the device caches of ``caches`` (the active and
        live versions always stay); returns the versions whose weights were dropped."""
        with self._lock:
            pinned = {self.active_version, self.live_version}
            dropped = [v for v in self._hosts if v not in set(hosts) | pinned]
            for name in dropped:
                del self._hosts[name]
            for name in [v for v in self._caches if v not in set(caches) | pinned]:
                self._caches.pop(name).close()
            return dropped

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every version's host weights and device-cache copies (for the model residency)."""
        with self._lock:
            hosts, caches = list(self._hosts.values()), list(self._caches.values())
        for host in hosts:
            yield from host.tensors()
        for cache in caches:
            yield from cache.tensors()

    def close(self) -> None:
        """Stop every version's copy lane (the session is being dropped)."""
        with self._lock:
            caches = list(self._caches.values())
        for cache in caches:
            cache.close()

    def tick(self, now_s: float) -> int:
        """Idle-unload on every version's device cache; returns the experts unloaded."""
        with self._lock:
            caches = list(self._caches.values())
        return sum(cache.tick(now_s) for cache in caches)


def read_expert_file(path: Path, like: HostExperts) -> HostExperts:
    """A version from a safetensors file, checked against ``like`` and cast to its dtype."""
    try:
        tensors = load_file(str(path))
    except (OSError, ValueError) as exc:  # safetensors raises its own error types as well
        raise ExpertVersionError(f"cannot read expert version file {path}: {exc}") from exc
    except Exception as exc:
        raise ExpertVersionError(f"{path} is not a safetensors expert file: {exc}") from exc
    gate_up, down = dict(like.gate_up), dict(like.down)
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ExpertVersionError(f"{path}: unexpected tensor {key!r}; expected "
                                     "layers.<i>.gate_up_proj and layers.<i>.down_proj")
        layer, kind = int(match.group(1)), match.group(2)
        target = gate_up if kind == "gate_up_proj" else down
        if layer not in target:
            raise ExpertVersionError(f"{path}: layer {layer} is not an MoE layer of this model")
        target[layer] = tensor.to(target[layer].dtype)
    if not tensors:
        raise ExpertVersionError(f"{path} holds no expert tensors")
    # expert biases (gpt-oss) and shared experts (DeepSeek-V3) are not part of a version file:
    # the version keeps the model's
    host = HostExperts(gate_up=gate_up, down=down, gate_up_bias=like.gate_up_bias,
                       down_bias=like.down_bias, shared_bytes=like.shared_bytes)
    _check_compatible(like, host, str(path))
    return host


def write_expert_file(host: HostExperts, path: Path) -> None:
    """Save every layer of ``host`` as a version file."""
    tensors = {}
    for layer in host.layers:
        tensors[f"layers.{layer}.gate_up_proj"] = host.gate_up[layer].contiguous()
        tensors[f"layers.{layer}.down_proj"] = host.down[layer].contiguous()
    save_file(tensors, str(path))


def perturbed_experts(host: HostExperts, scale: float, seed: int = 0) -> HostExperts:
    """A copy of ``host`` with relative Gaussian noise of ``scale`` (a stand-in fine-tune for
    drills: ``scale=nan`` makes a broken version)."""
    gen = torch.Generator().manual_seed(seed)

    def noisy(t: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype)
        return t + t.abs().mean() * scale * noise

    return HostExperts(gate_up={k: noisy(v) for k, v in host.gate_up.items()},
                       down={k: noisy(v) for k, v in host.down.items()},
                       gate_up_bias=host.gate_up_bias, down_bias=host.down_bias,
                       shared_bytes=host.shared_bytes)


def _check_compatible(live: HostExperts, new: HostExperts, what: str) -> None:
    if new.layers != live.layers:
        raise ExpertVersionError(f"{what}: MoE layers {new.layers} differ from {live.layers}")
    for layer in live.layers:
        for name, a, b in (("gate_up_proj", live.gate_up[layer], new.gate_up[layer]),
                           ("down_proj", live.down[layer], new.down[layer])):
            if a.shape != b.shape:
                raise ExpertVersionError(f"{what}: layer {layer} {name} has shape "
                                         f"{tuple(b.shape)}, the model needs {tuple(a.shape)}")
