"""Freeing and restoring a runner's device memory (``release_memory_occupation`` /
``resume_memory_occupation``, SGLang's sleep and wake for RL).

Two tags, SGLang's: ``kv_cache`` is the KV pages and GDN state slots (``runner.cache``), the
prefix cache's GDN snapshots, the MTP KV pages (NEXTN) and the sampler's per-slot penalty
state; ``weights`` is the params (and the MTP params). Releasing a tag deletes its device
arrays (``jax.Array.delete``: the memory is free on return); the weights are first copied to
the host as numpy (one copy of the whole params in host memory while asleep), the KV state
is dropped (nothing may be running: it is recreated as zeros, which is what start-up made).
Resuming places each array again with the placement it had (sharding, device layout,
committed), checked leaf by leaf, so every compiled step program is reused as is: waking
compiles nothing.

The caller (``managers/rl_control.py``) makes sure no step is in flight and no request holds
pages or slots, and that nothing reads the released arrays until they are back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from sglang_tpu_backend.model_executor.weight_layout import weight_target
from sglang_tpu_backend.model_executor.weight_update import placement

TAGS = ("kv_cache", "weights")


@dataclasses.dataclass
class _Held:
    """One released attribute: ``owner.name`` was a pytree of arrays (``treedef``); per leaf
    its placement, where to put it (format or sharding) and, for weights, its host copy."""

    owner: Any
    name: str
    treedef: Any
    placements: list[tuple]
    targets: list[Any]
    shapes: list[tuple[tuple[int, ...], Any]]
    host: list[np.ndarray] | None  # None: zeros on resume

    def restore(self) -> None:
        leaves = []
        for i, (target, (shape, dtype)) in enumerate(zip(self.targets, self.shapes)):
            value = self.host[i] if self.host is not None else np.zeros(shape, dtype)
            leaves.append(jax.device_put(value, target))
            if self.host is not None:
                self.host[i] = None  # host memory back as the device copy lands
        leaves = jax.block_until_ready(leaves)
        got = [placement(a) for a in leaves]
        if got != self.placements:
            bad = next(i for i, (a, b) in enumerate(zip(got, self.placements)) if a != b)
            raise RuntimeError(f"{self.name} leaf {bad} came back as {got[bad]}, not "
                               f"{self.placements[bad]} (the step programs would recompile)")
        setattr(self.owner, self.name, jax.tree.unflatten(self.treedef, leaves))


def _release(owner: Any, name: str, keep_host: bool) -> _Held:
    """Delete ``owner.name``'s device arrays (copied to the host first when ``keep_host``)."""
    leaves, treedef = jax.tree.flatten(getattr(owner, name))
    host = [np.asarray(x) for x in jax.device_get(leaves)] if keep_host else None
    targets = [weight_target(a) if keep_host else a.sharding for a in leaves]  # (KV: default layout)
    held = _Held(owner, name, treedef, [placement(a) for a in leaves], targets,
                 [(tuple(a.shape), a.dtype) for a in leaves], host)
    setattr(owner, name, None)
    for a in leaves:
        a.delete()
    return held


class DeviceMemory:
    """What of one runner is released, per tag (``runner``: a ``ModelRunner``)."""

    def __init__(self, runner: Any):
        self.runner = runner
        self.released: dict[str, list[_Held]] = {}

    def _holders(self, tag: str) -> list[tuple[Any, str]]:
        r = self.runner
        if tag == "weights":
            return [(r, "params")] + ([(r.nextn, "params")] if r.nextn is not None else [])
        out = [(r, "cache"), (r.sampler, "counts"), (r.sampler, "prompt_mask")]
        if r.snapshots is not None:
            out += [(r.snapshots, "conv"), (r.snapshots, "rec")]
        if r.nextn is not None:
            out.append((r.nextn, "cache"))
        return out

    def release(self, tags: list[str]) -> int:
        """Release ``tags`` (those not released yet); returns the device bytes freed."""
        freed = 0
        for tag in tags:
            if tag in self.released:
                continue
            held = []
            for owner, name in self._holders(tag):
                freed += sum(a.nbytes for a in jax.tree.leaves(getattr(owner, name)))
                held.append(_release(owner, name, keep_host=tag == "weights"))
            self.released[tag] = held
        return freed

    def resume(self, tags: list[str]) -> None:
        """Place ``tags``' arrays again (those released), exactly as they were."""
        for tag in tags:
            for held in self.released.pop(tag, []):
                held.restore()
