"""EPLB placement on its own (``parallel/eplb.py``, numpy), the physical-slot routing of
``models/moe.py``, the on-device expert move, load files and the EPLB flags."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sglang_tpu_backend.parallel import eplb
from sglang_tpu_backend.server_args import ServerArgs


def _zipf_loads(layers=4, experts=16, seed=0):
    return np.random.default_rng(seed).zipf(1.6, (layers, experts)).astype(np.float64)


def test_trivial_location_and_tables():
    loc = eplb.ExpertLocation.trivial(2, 4, 6)
    assert loc.logical.tolist() == [[0, 1, 2, 3, 0, 1]] * 2 and loc.max_copies == 3
    physical, copies = loc.tables()
    assert copies[0].tolist() == [2, 2, 1, 1]
    assert physical[0, 0].tolist() == [0, 4, 0] and physical[0, 3].tolist() == [3, 3, 3]
    assert loc.logical_loads(np.ones((2, 6)))[0].tolist() == [2, 2, 1, 1]
    assert loc.split_loads(np.array([[4, 2, 1, 1]] * 2))[0].tolist() == [2, 1, 1, 1, 2, 1]


def test_location_rejects_a_missing_expert():
    with pytest.raises(ValueError, match=r"every expert needs a slot.*\[\[0, 2\]\]"):
        eplb.ExpertLocation(np.array([[0, 1, 1, 3]]), 4)


@pytest.mark.parametrize("num_physical", [16, 24, 32])
def test_placement_is_valid_and_balances(num_physical):
    """Every expert keeps a slot, each rank holds P/D slots, the hottest experts get the
    copies, and the expected per-rank max/mean is at most the trivial placement's (and much
    lower with redundant slots)."""
    loads = _zipf_loads()
    loc = eplb.place_experts(loads, num_physical, 8)
    assert loc.logical.shape == (4, num_physical)
    counts = np.stack([np.bincount(r, minlength=16) for r in loc.logical])
    assert (counts >= 1).all() and (counts <= 8).all()
    for layer in range(4):  # a copy more only for an expert at least as hot per copy
        hottest = np.argmax(loads[layer])
        assert counts[layer, hottest] == counts[layer].max()
        per_rank = loc.logical[layer].reshape(8, -1)
        assert all(len(set(r)) == len(r) for r in per_rank)  # no two copies on one rank
    trivial = eplb.ExpertLocation.trivial(4, 16, num_physical)

    def ratio(location):
        return eplb.balance_ratio(location.rank_loads(location.split_loads(loads), 8))

    assert (ratio(loc) <= ratio(trivial) + 1e-9).all()
    if num_physical == 32:
        assert ratio(loc).max() < 1.3 < ratio(trivial).min()
    again = eplb.place_experts(loads, num_physical, 8)
    assert (again.logical == loc.logical).all()  # deterministic


def test_placement_rejects_bad_sizes():
    with pytest.raises(ValueError, match="multiple of 8"):
        eplb.place_experts(np.ones((1, 16)), 20, 8)
    with pytest.raises(ValueError, match=">= 16 experts"):
        eplb.place_experts(np.ones((1, 16)), 8, 8)


def test_physical_ids_pick_a_copy_per_row():
    from sglang_tpu_backend.models.moe import physical_ids

    loc = eplb.ExpertLocation(np.array([[2, 0, 1, 2, 3, 2]]), 4)  # expert 2 in slots 0, 3, 5
    physical, copies = loc.tables()
    location = {"physical": jnp.asarray(physical[0]), "copies": jnp.asarray(copies[0]),
                "logical": jnp.asarray(loc.logical[0])}
    top_i = jnp.array([[2, 0], [2, 3], [2, 1], [4, 4]], jnp.int32)  # row 3: padding (id E)
    out = np.asarray(physical_ids(top_i, location))
    assert out[:, 0].tolist() == [0, 3, 5, 6]  # copy (t + k) mod 3; padding -> P
    assert out[:3, 1].tolist() == [1, 4, 2] and out[3, 1] == 6
    assert (loc.logical[0][out[:3]] == np.asarray(top_i[:3])).all()  # a slot of the same expert


def test_source_slots_prefer_the_same_rank():
    from sglang_tpu_backend.model_executor.expert_location import source_slots

    old, new = np.array([0, 1, 2, 0]), np.array([0, 2, 1, 0])  # 2 ranks of 2 slots
    assert source_slots(old, new, 2).tolist() == [0, 2, 1, 3]


def test_load_file_round_trip_and_errors(tmp_path):
    path = tmp_path / "loads.json"
    loads = np.arange(8.0).reshape(2, 4)
    eplb.write_load_file(path, loads, [0, 2])
    assert (eplb.read_load_file(path, 4, [0, 2]) == loads).all()
    with pytest.raises(ValueError, match="--init-expert-location .*recorded for 4 experts"):
        eplb.read_load_file(path, 8, [0, 2])
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "loads": [[1, 2, 3, -1], [0, 0, 0, 0]]}))
    with pytest.raises(ValueError, match="--init-expert-location .*non-negative"):
        eplb.read_load_file(path, 4, [0, 2])
    path.write_text("not json")
    with pytest.raises(ValueError, match="--init-expert-location"):
        eplb.read_load_file(path, 4, [0, 2])


def test_initial_location_from_a_load_file(tmp_path):
    from sglang_tpu_backend.config import load_model_config
    from sglang_tpu_backend.model_executor.expert_balancer import initial_location
    from sglang_tpu_backend.model_executor.expert_location import moe_layers
    from sglang_tpu_backend.model_loader.tiny_model import default_model_path

    cfg = load_model_config(default_model_path())
    path = tmp_path / "loads.json"
    loads = _zipf_loads(len(moe_layers(cfg)), cfg.num_experts)
    eplb.write_load_file(path, loads, moe_layers(cfg))
    loc = initial_location(cfg, num_redundant=8, init_expert_location=str(path), num_ranks=8)
    assert (loc.logical == eplb.place_experts(np.round(loads), 24, 8).logical).all()
    triv = initial_location(cfg, num_redundant=0, init_expert_location="trivial", num_ranks=8)
    assert (triv.logical == np.arange(16)).all()
    with pytest.raises(ValueError, match="--ep-num-redundant-experts 3"):
        initial_location(cfg, num_redundant=3, init_expert_location=None, num_ranks=8)


def test_expert_move_on_device_matches_a_fresh_placement():
    """Params moved from one placement to another on the device equal the host params
    placed for the new one, leaf for leaf, with the same shardings (one device here; the
    8-device move under the DP step's shardings runs in ``dp_ep_run.py``)."""
    from sglang_tpu_backend.model_loader.loader import load_model
    from sglang_tpu_backend.model_executor.expert_balancer import ExpertBalancer
    from sglang_tpu_backend.model_executor.expert_location import (ExpertMover, apply_location,
                                                                   params_location)
    from sglang_tpu_backend.model_loader.tiny_model import default_model_path

    cfg, params = load_model(default_model_path(), dtype=jnp.float32)
    old = eplb.ExpertLocation.trivial(8, 16, 24)
    new = eplb.place_experts(_zipf_loads(8, 16), 24, 8)
    placed = jax.device_put(apply_location(params, cfg, old))
    shardings = [a.sharding for a in jax.tree.leaves(placed)]
    moved = ExpertMover(cfg, 8).move(placed, new)
    want = apply_location(params, cfg, new)
    for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [a.sharding for a in jax.tree.leaves(moved)] == shardings
    assert (params_location(moved, cfg).logical == new.logical).all()
    # A runner swapping in params placed for another location (a weight update placed before
    # a rebalance) adopts their location and keeps the loads recorded so far.
    balancer = ExpertBalancer(cfg, old, 8)
    balancer.record(np.ones((8, 24)))
    balancer.adopt(moved)
    assert (balancer.location.logical == new.logical).all() and balancer.window.num_steps == 0
    assert (balancer.recorded == old.logical_loads(np.ones((8, 24)))).all()


@pytest.mark.parametrize("kwargs,flag", [
    (dict(ep_num_redundant_experts=-1), "--ep-num-redundant-experts"),
    (dict(eplb_rebalance_num_iterations=0), "--eplb-rebalance-num-iterations"),
    (dict(enable_eplb=True, tp_size=2), "--enable-eplb"),
    (dict(ep_num_redundant_experts=2, dp_size=2, nnodes=2, dist_init_addr="h:1",
          disable_radix_cache=True), "--nnodes 2"),
])
def test_eplb_flags_are_validated(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        ServerArgs(**kwargs)


def test_redundant_slots_must_split_over_the_ep_ranks():
    args = ServerArgs(dp_size=8, ep_num_redundant_experts=4)
    with pytest.raises(ValueError, match="--ep-num-redundant-experts 4"):
        args.check_devices(8, 16)
    ServerArgs(dp_size=8, ep_num_redundant_experts=8).check_devices(8, 16)
    assert ServerArgs(enable_eplb=True).uses_expert_location
    assert not ServerArgs(init_expert_location="trivial").uses_expert_location
