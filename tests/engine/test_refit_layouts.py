"""``update_weights_from_tensor`` where the serving params are not laid out as loaded: experts
stored per physical slot after an EPLB rebalance (one device), and NEXTN's MTP layers. The
TP and DP+EP engines' refits are in ``test_rl_surface.py`` (``rl_dp_run.py``). A rebalance
while an update is built refuses it (retry message, the serving params kept); a retry lands.

Checkpoint "M" is the tiny model's own tensors with some edited: layer 0's experts rolled by
one and scaled, two experts of layer 3 swapped, layer 3's ``k_proj`` scaled and ``v_proj``
rows reversed, layer 0's GDN ``in_proj_qkv`` scaled, and the MTP layer's ``fc`` and experts
scaled.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.conftest import ENGINE_ARGS
from tests.engine.engine_runs import run_each

L = "model.language_model.layers."
EPLB_ARGS = {**ENGINE_ARGS, "max_running_requests": 8, "ep_num_redundant_experts": 8,
             "enable_eplb": True, "eplb_rebalance_num_iterations": 10_000}
# The tensors M edits outside the MTP layer (the ones an engine without NEXTN serves).
EDITED = [f"{L}0.mlp.experts.gate_up_proj", f"{L}0.mlp.experts.down_proj",
          f"{L}3.mlp.experts.down_proj", f"{L}3.self_attn.k_proj.weight",
          f"{L}3.self_attn.v_proj.weight", f"{L}0.linear_attn.in_proj_qkv.weight"]
NEXTN_ARGS = {**ENGINE_ARGS, "max_running_requests": 8, "speculative_algorithm": "NEXTN",
              "speculative_num_steps": 3}


def _edited(tensors: dict) -> dict:
    """A copy of ``tensors`` (checkpoint name -> bf16 array) with M's edits."""
    out = dict(tensors)

    def edit(name, fn):
        out[name] = fn(tensors[name].astype(np.float32)).astype(tensors[name].dtype)

    edit(f"{L}0.mlp.experts.gate_up_proj", lambda x: 1.5 * np.roll(x, 1, axis=0))
    edit(f"{L}0.mlp.experts.down_proj", lambda x: np.roll(x, 1, axis=0))
    edit(f"{L}3.mlp.experts.down_proj", lambda x: x[[0, 1, 7, 3, 4, 5, 6, 2, *range(8, x.shape[0])]])
    edit(f"{L}3.self_attn.k_proj.weight", lambda x: 1.3 * x)
    edit(f"{L}3.self_attn.v_proj.weight", lambda x: x[::-1])
    edit(f"{L}0.linear_attn.in_proj_qkv.weight", lambda x: 0.8 * x)
    edit("mtp.fc.weight", lambda x: 1.2 * x)
    edit("mtp.layers.0.mlp.experts.gate_up_proj", lambda x: 2.0 * np.roll(x, 3, axis=0))
    return out


@pytest.fixture(scope="module")
def ckpt_m(tmp_path_factory):
    """(M's tensors, its checkpoint directory)."""
    from sglang_tpu_backend.model_loader.checkpoint_io import read_checkpoint
    from sglang_tpu_backend.model_loader.tiny_model import default_model_path, write_random_model

    m = _edited(read_checkpoint(default_model_path()))

    def edit(config, tensors):
        tensors.clear()
        tensors.update(m)

    return m, write_random_model(tmp_path_factory.mktemp("weights") / "m", seed=0, edit=edit)


@pytest.fixture(scope="module")
def m_reference(ckpt_m):
    """(greedy tokens, params on the host) of an engine without EPLB started on M."""
    import jax

    ref = _engine(ENGINE_ARGS, ckpt_m[1])
    try:
        return _tokens(ref), jax.device_get(ref.runner.params)
    finally:
        ref.shutdown()


def _engine(args, path=None):
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.server_args import ServerArgs

    return Engine(ServerArgs(**args, **({} if path is None else {"model_path": str(path)})))


def _tokens(eng):
    eng.flush_cache()
    return [o["output_ids"] for o in run_each(eng)]


def _leaves(tree):
    import jax

    return [np.asarray(jax.device_get(x)) for x in jax.tree.leaves(tree)]


def test_refit_lands_in_every_physical_slot_after_a_rebalance(ckpt_m, m_reference):
    """An EPLB engine (16 experts in 24 slots) rebalanced onto a placement that is not the
    start-up one takes M's tensors by their logical names, in two calls: every slot holds its
    logical expert's M weights (replicas included), shardings are kept, and the greedy tokens
    are those of an engine without EPLB started on M."""
    import jax

    tensors, _ = ckpt_m
    want, want_params = m_reference
    eng = _engine(EPLB_ARGS)
    try:
        before = _tokens(eng)
        runner, balancer = eng.runner, eng.runner.balancer
        start = balancer.location.logical.copy()
        _rebalance(runner)  # the loop is idle: no step runs
        assert _tokens(eng) == before  # the move alone changes nothing
        old = jax.tree.leaves(runner.params)
        names = sorted(tensors)
        for half in (names[::2], names[1::2]):
            res = eng.update_weights_from_tensor({n: tensors[n] for n in half})
            assert res["success"], res
        new = jax.tree.leaves(runner.params)
        assert len(new) == len(old) and all(a.sharding == b.sharding for a, b in zip(new, old))
        assert (balancer.location.logical != start).any()  # the rebalanced placement serves
        for g, group in enumerate(runner.params["layer_groups"]):
            mlp = group["mlp"]
            if "experts" not in mlp:
                continue
            logical = np.asarray(mlp["expert_location"]["logical"])  # [G, P]
            rows = np.arange(logical.shape[0])[:, None]
            for k, leaf in mlp["experts"].items():
                ref_leaf = np.asarray(want_params["layer_groups"][g]["mlp"]["experts"][k])
                np.testing.assert_array_equal(np.asarray(leaf), ref_leaf[rows, logical])
        got = _tokens(eng)
        assert got == want and got != before
    finally:
        eng.shutdown()


def _rebalance(runner, seed: int = 0) -> None:
    """An EPLB rebalance of ``runner`` (16 experts in 24 slots) for random loads onto a
    placement that is not the current one; call with the loop idle (no step runs)."""
    from sglang_tpu_backend.model_executor.expert_location import moe_layers

    balancer = runner.balancer
    start = balancer.location.logical.copy()
    loads = np.random.default_rng(seed).gamma(0.3, size=(len(moe_layers(runner.cfg)), 24)) * 100
    balancer.window.add(loads)
    runner.params = balancer.rebalance(runner.params)
    assert (balancer.location.logical != start).any()


# Where the rebalance lands in an update -> the refusal it gets.
RACES = {"built": "the serving params changed while the update was built (an EPLB rebalance); "
                  "retry",
         "queued": "the serving params changed before the swap (an EPLB rebalance moved the "
                   "experts); retry the update"}


def _rebalance_once_when(stage: str, runner, monkeypatch) -> list:
    """Hook the first update's ``stage`` to run a rebalance there: "built" right after
    ``build_params`` returns (the update built from the old params), "queued" as its
    ``PendingSwap`` is made (the update handed to the loop). Returns the list the rebalanced
    params are put in."""
    from sglang_tpu_backend.model_executor import tensor_update, weight_update

    rebalanced: list = []

    def once():
        if not rebalanced:
            _rebalance(runner)
            rebalanced.append(runner.params)

    if stage == "built":
        build = tensor_update.build_params

        def build_then_rebalance(*args, **kwargs):
            built = build(*args, **kwargs)
            once()
            return built

        monkeypatch.setattr(tensor_update, "build_params", build_then_rebalance)
    else:
        class RebalancedSwap(weight_update.PendingSwap):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                once()

        monkeypatch.setattr(weight_update, "PendingSwap", RebalancedSwap)
    return rebalanced


@pytest.mark.parametrize("stage", sorted(RACES))
def test_a_rebalance_during_an_update_refuses_it_and_a_retry_lands(
        stage, ckpt_m, m_reference, monkeypatch):
    """The EPLB race guards of ``update_weights_from_tensor``: a real rebalance replaces the
    serving params after the update was built from them, or after it was queued for the swap:
    the update is refused with the retry message, the engine keeps serving the rebalanced
    params (greedy tokens and weight version unchanged); the same update again lands in the
    new placement and serves M's greedy tokens."""
    tensors, _ = ckpt_m
    want, _ = m_reference
    named = {n: tensors[n] for n in EDITED}  # M = the tiny model with these edited
    eng = _engine(EPLB_ARGS)
    try:
        runner, before, version = eng.runner, _tokens(eng), eng.get_weight_version()
        rebalanced = _rebalance_once_when(stage, runner, monkeypatch)
        res = eng.update_weights_from_tensor(named, weight_version="m-1")
        assert res == {"success": False, "num_paused_requests": 0, "message": RACES[stage]}
        assert runner.params is rebalanced[0] and eng.get_weight_version() == version
        assert _tokens(eng) == before
        res = eng.update_weights_from_tensor(named, weight_version="m-1")
        assert res["success"], res
        assert eng.get_weight_version() == "m-1" and runner.params is not rebalanced[0]
        got = _tokens(eng)
        assert got == want and got != before
    finally:
        eng.shutdown()


def test_refit_updates_the_mtp_layers(ckpt_m):
    """A NEXTN engine takes M's tensors, ``mtp.*`` included, in two calls (the second merges
    into MTP leaves the first built): its MTP params equal those of a NEXTN engine started on
    M, and so do its greedy tokens and verify counts (the drafts' acceptance). A misshapen or
    unknown ``mtp.*`` tensor is refused naming it."""
    tensors, path = ckpt_m

    def run(eng):
        eng.flush_cache()
        outs = run_each(eng)
        return [(o["output_ids"], o["meta_info"]["spec_verify_ct"]) for o in outs]

    ref = _engine(NEXTN_ARGS, path)
    try:
        want, want_mtp = run(ref), _leaves(ref.runner.nextn.params)
    finally:
        ref.shutdown()
    eng = _engine(NEXTN_ARGS)
    try:
        old_mtp = eng.runner.nextn.params
        import jax

        old = jax.tree.leaves(old_mtp)
        assert any((a != b).any() for a, b in zip(_leaves(old_mtp), want_mtp))
        for bad, named in [({"mtp.fc.weight": tensors["mtp.fc.weight"][:-1]}, "mtp.fc.weight"),
                           ({"mtp.layers.4.input_layernorm.weight": tensors["mtp.norm.weight"]},
                            "mtp.layers.4.input_layernorm.weight")]:
            res = eng.update_weights_from_tensor(bad)  # refused naming it, nothing changed
            assert not res["success"] and named in res["message"], res
        assert eng.runner.nextn.params is old_mtp
        names = sorted(tensors)
        for half in ([n for n in names if n.startswith("mtp.")][::2],
                     [n for n in names if not n.startswith("mtp.")] +
                     [n for n in names if n.startswith("mtp.")][1::2]):
            res = eng.update_weights_from_tensor({n: tensors[n] for n in half})
            assert res["success"], res
        new = jax.tree.leaves(eng.runner.nextn.params)
        assert all(a.sharding == b.sharding for a, b in zip(new, old))
        for a, b in zip(_leaves(eng.runner.nextn.params), want_mtp):
            np.testing.assert_array_equal(a, b)
        assert run(eng) == want
    finally:
        eng.shutdown()
