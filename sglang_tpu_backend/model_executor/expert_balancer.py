"""One runner's EPLB state: the serving expert location, the recorded loads, the rebalance.

Each step's router stats carry the real rows routed to every physical expert slot, summed
over the EP ranks (f32[layers, P], ``metrics/router_stats.py``); ``record`` adds them (MoE
layers only) into rows per slot since the last rebalance, what the next placement and the
per-rank balance are computed from, and, while recording (from start-up, or from
``start_record`` until ``stop_record``), into rows per logical expert: what ``dump`` writes as
a load file for ``--init-expert-location`` (SGLang's expert distribution record).
Without EPLB the runner keeps one too, over the identity placement of the logical experts
(``stores_physical=False``: the params stay as loaded), so loads and the per-rank balance
are recorded on any engine with router stats. Every
``--eplb-rebalance-num-iterations`` steps (with ``--enable-eplb``) the runner calls
``rebalance`` between two steps: a new placement from the window's loads, the expert weights
moved on the devices (``expert_location.ExpertMover``), the window reset.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from sglang_tpu_backend.config import ModelConfig
from sglang_tpu_backend.model_executor.expert_location import (ExpertMover, apply_location,
                                                               moe_layers, params_location)
from sglang_tpu_backend.parallel import eplb

logger = logging.getLogger(__name__)


class ExpertBalancer:
    """EPLB of one runner (``num_ranks`` EP ranks). ``rebalance_every``: steps between
    rebalances, None for a fixed placement. ``stores_physical``: the params hold experts per
    physical slot of ``location`` (else the logical experts, ``location`` the identity)."""

    def __init__(self, cfg: ModelConfig, location: eplb.ExpertLocation, num_ranks: int,
                 rebalance_every: int | None = None, stores_physical: bool = True):
        if rebalance_every is not None and not stores_physical:
            raise ValueError("rebalancing needs experts stored per physical slot")
        if location.num_physical % num_ranks:
            raise ValueError(f"--ep-num-redundant-experts: {location.num_physical} physical expert "
                             f"slots must be a multiple of the {num_ranks} EP ranks")
        self.cfg, self.location, self.num_ranks = cfg, location, num_ranks
        self.rebalance_every, self.stores_physical = rebalance_every, stores_physical
        self.layers = moe_layers(cfg)
        self.window = eplb.ExpertLoadRecorder(location.num_layers, location.num_physical)
        self.recording = True
        self.recorded = np.zeros((location.num_layers, location.num_experts))  # rows per expert
        self.num_rebalances = 0
        self.mover = ExpertMover(cfg, num_ranks)

    def physical(self, params: Any) -> Any:
        """Loaded (logical) host params stored per physical slot of the serving location."""
        return apply_location(params, self.cfg, self.location) if self.stores_physical else params

    def record(self, slot_counts: np.ndarray) -> None:
        """Add one step's rows per physical slot f32[num_hidden_layers, P]."""
        counts = np.asarray(slot_counts, np.float64)[self.layers]  # [L, P]
        self.window.add(counts)
        if self.recording:
            self.recorded = self.recorded + self.location.logical_loads(counts)

    def start_record(self) -> None:
        """Record the rows per logical expert from now on (what was recorded is dropped)."""
        self.recorded = np.zeros_like(self.recorded)
        self.recording = True

    def stop_record(self) -> None:
        """Stop adding to the record (EPLB keeps measuring its window)."""
        self.recording = False

    def rank_balance(self) -> np.ndarray:
        """Per MoE layer max / mean of the rows each EP rank's slots received since the last
        rebalance, f[L] (NaN for a layer with no rows)."""
        return eplb.balance_ratio(self.location.rank_loads(self.window.counts, self.num_ranks))

    @property
    def due(self) -> bool:
        return self.rebalance_every is not None and self.window.num_steps >= self.rebalance_every

    def rebalance(self, params: Any) -> Any:
        """A placement for the window's loads applied to ``params`` (placed, physical; their
        expert arrays are donated); returns the new params. Call with no step in flight."""
        before = self.rank_balance()
        loads = self.location.logical_loads(self.window.counts)
        location = eplb.place_experts(loads, self.location.num_physical, self.num_ranks)
        params = self.mover.move(params, location)
        self.location = location
        after = eplb.balance_ratio(location.rank_loads(location.split_loads(loads), self.num_ranks))
        logger.info("EPLB rebalance %d after %d steps: per-rank max/mean (mean over layers) %.3f "
                    "recorded, %.3f expected", self.num_rebalances + 1, self.window.num_steps,
                    np.nanmean(before), np.nanmean(after))
        self.window.reset()
        self.num_rebalances += 1
        return params

    def adopt(self, params: Any) -> None:
        """Serve ``params`` (placed by ``physical`` earlier, e.g. a weight update's): the loads
        recorded so far are kept, the location becomes the one the params hold."""
        if self.stores_physical:
            self.window.reset()
            self.location = params_location(params, self.cfg)

    def dump(self, path: str | Path) -> None:
        """Write the recorded rows per logical expert as a load file."""
        eplb.write_load_file(path, self.recorded, self.layers)


def initial_location(cfg: ModelConfig, *, num_redundant: int, init_expert_location: str | None,
                     num_ranks: int) -> eplb.ExpertLocation:
    """The start-up location: ``trivial`` / unset -> slot p holds expert p mod E; a load file
    -> ``place_experts`` of its loads."""
    layers = moe_layers(cfg)
    num_physical = cfg.num_experts + num_redundant
    if num_physical % num_ranks:
        raise ValueError(f"--ep-num-redundant-experts {num_redundant}: {num_physical} physical "
                         f"expert slots must be a multiple of the {num_ranks} EP ranks")
    if init_expert_location in (None, "trivial"):
        return eplb.ExpertLocation.trivial(len(layers), cfg.num_experts, num_physical)
    loads = eplb.read_load_file(init_expert_location, cfg.num_experts, layers)
    return eplb.place_experts(loads, num_physical, num_ranks)


def make_balancer(cfg: ModelConfig, location: eplb.ExpertLocation | None, num_ranks: int,
                  rebalance_every: int | None = None) -> ExpertBalancer:
    """A runner's balancer: EPLB's over ``location``, or without one (None) the load recorder
    of the logical experts as loaded (rank r holds experts [r*E/D, (r+1)*E/D)), never
    rebalanced."""
    if location is not None:
        return ExpertBalancer(cfg, location, num_ranks, rebalance_every)
    identity = eplb.ExpertLocation.trivial(len(moe_layers(cfg)), cfg.num_experts, cfg.num_experts)
    return ExpertBalancer(cfg, identity, num_ranks, rebalance_every, stores_physical=False)
