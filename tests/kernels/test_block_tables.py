"""kernels/block_tables.py: the per-TPU-generation block-size table, its lookup and the kernel
wrappers' one seam each; benchmarks/sweep_block_sizes.py's choice and table writing.

A fake device kind and table (monkeypatched) stand for a chip: the wrappers must take a legal
override, ignore an illegal one, and still match the reference in interpret mode.
"""

from __future__ import annotations

import dataclasses
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from sglang_tpu_backend.kernels import block_tables, gdn, gdn_kernels, gmm, routing  # noqa: E402
from sglang_tpu_backend.kernels import ragged_paged_attention as rpa  # noqa: E402
from sglang_tpu_backend.kernels.gdn_common import conv_state_rows  # noqa: E402
from tests.scripts import load_script

FAKE = "TPU fake"
DATACLASSES = {"attention": rpa.BlockSizes, "gdn": gdn.GdnBlockSizes,
               "gmm": gmm.GmmBlockSizes, "routing": routing.RoutingBlockSizes}


@pytest.fixture(autouse=True)
def _reset_interpret_state():
    yield
    if hasattr(pltpu, "reset_tpu_interpret_mode_state"):
        pltpu.reset_tpu_interpret_mode_state()


def _fake_chip(monkeypatch, kernel: str, over: dict | None):
    """This process looks like a FAKE chip whose table sets ``over`` for ``kernel``."""
    table = {FAKE: {kernel: {"overrides": over, "timed": True, "source": "test"}}} if over else {}
    monkeypatch.setattr(block_tables, "load_table", lambda: table)
    monkeypatch.setattr(block_tables, "current_device_kind", lambda: FAKE)


def _spy(monkeypatch, module, name, seen: list, pick):
    real = getattr(module, name)

    def spy(*a, **k):
        seen.append(pick(a, k))
        return real(*a, **k)

    monkeypatch.setattr(module, name, spy)


# ----------------------------------------------------------------------------- lookup


def test_no_overrides_off_tpu_or_for_an_unknown_device_kind():
    assert block_tables.current_device_kind() is None  # JAX_PLATFORMS=cpu
    for kernel in block_tables.FIELDS:
        assert block_tables.overrides(kernel, None) == {}
        assert block_tables.overrides(kernel, "TPU v99 unknown") == {}
    default = gdn.GdnBlockSizes(1)
    assert block_tables.pick("gdn", default, lambda b: True) is default
    with pytest.raises(ValueError, match="unknown kernel"):
        block_tables.overrides("flash", "TPU7x")


def test_aliases_and_illegal_override_falls_back(monkeypatch):
    table = {"TPU v5 lite": {"gdn": {"overrides": {"k_heads_per_block": 3}, "timed": True,
                                     "source": "test"}}}
    monkeypatch.setattr(block_tables, "load_table", lambda: table)
    assert block_tables.overrides("gdn", "TPU v5e") == {"k_heads_per_block": 3}  # alias
    def legal(b):  # the 397B heads: Hk 16, Hv 64, D 128
        return gdn_kernels.block_error(16, 64, 128, 128, b.k_heads_per_block) is None

    default = gdn.GdnBlockSizes(1)
    # 3 does not divide Hk = 16: the default stays; 4 does and is taken
    assert block_tables.apply(default, {"k_heads_per_block": 3}, legal) == default
    assert block_tables.apply(default, {"k_heads_per_block": 4}, legal) == gdn.GdnBlockSizes(4)
    monkeypatch.setattr(block_tables, "current_device_kind", lambda: "TPU v5e")
    assert block_tables.pick("gdn", default, legal) == default
    with block_tables.disabled():
        assert block_tables.pick("gdn", default, lambda b: True) == default


def test_table_parses_and_names_known_kernels_and_fields():
    table = json.loads(block_tables.TABLE_PATH.read_text())
    assert block_tables.load_table() == table["device_kinds"]
    assert set(table["device_kinds"]) >= {"TPU v5 lite", "TPU7x"}
    for kernel, cls in DATACLASSES.items():  # FIELDS is the dataclasses' fields
        assert block_tables.FIELDS[kernel] == tuple(f.name for f in dataclasses.fields(cls))
    for kind, kernels in table["device_kinds"].items():
        for kernel, e in kernels.items():
            assert kernel in block_tables.FIELDS, (kind, kernel)
            assert isinstance(e["timed"], bool) and e["source"], (kind, kernel)
            assert set(e["overrides"]) <= set(block_tables.FIELDS[kernel]), (kind, kernel)
            if not e["timed"]:  # an untimed entry changes nothing
                assert e["overrides"] == {}, (kind, kernel)
            for c in e.get("candidates", []):
                assert set(c["blocks"]) <= set(block_tables.FIELDS[kernel]), (kind, kernel, c)


# ----------------------------------------------------------------------------- wrappers


def _gdn_case(hk=2, hv=4, d=128, k=4, reqs=2):
    rng = np.random.default_rng(0)
    c = 2 * hk * d + hv * d
    f32 = lambda *s, scale=1.0: jnp.asarray(rng.normal(size=s) * scale, jnp.float32)  # noqa: E731
    cs = np.zeros((1, 4, conv_state_rows(k), c))
    cs[:, :, : k - 1] = rng.normal(size=(1, 4, k - 1, c))
    return (f32(reqs, c), f32(reqs, hv), f32(reqs, hv), f32(c, k, scale=0.5),
            jnp.log(jnp.linspace(0.05, 4.0, hv)), f32(hv) - 1.0, jnp.asarray(cs, jnp.float32),
            f32(1, 4, hv, d, d, scale=0.3), jnp.arange(reqs + 1, dtype=jnp.int32),
            jnp.asarray([3, 1], jnp.int32), jnp.asarray([1, 2], jnp.int32),
            jnp.asarray([reqs], jnp.int32))


@pytest.mark.parametrize("over,want", [
    (None, (2, 2)), ({"k_heads_per_block": 1}, (1, 2)), ({"k_heads_per_block": 3}, (2, 2)),
    ({"rows_per_step": 1}, (2, 1)), ({"rows_per_step": 0}, (2, 2)),
    ({"rows_per_step": 16}, (2, 2)), ({"k_heads_per_block": 1, "rows_per_step": 1}, (1, 1))])
def test_gdn_wrapper_takes_the_table(monkeypatch, over, want):
    """Hk 2, Hv 4, D 128, f32 state, T 2 decode rows: the default decode block is both qk
    heads (one holds 128 KiB of state, under the 256 KiB the decode default asks for) and 2
    rows per step (8 capped at T); the fake chip's 1 head is taken, its 3 (not a divisor of
    Hk) falls back to the default; its rows_per_step 1 is taken, 0 (illegal) gives the
    default, 16 is capped at T; the output matches the reference either way."""
    _fake_chip(monkeypatch, "gdn", over)
    seen = []
    _spy(monkeypatch, gdn_kernels, "pallas_gdn", seen, lambda a, k: (k["geom"].kb, k["geom"].rb))
    args = _gdn_case()
    got = gdn.gated_delta_net(*args, num_k_heads=2, decode=True, impl="interpret")
    want_out = gdn.ref_gated_delta_net(*args, num_k_heads=2, decode=True)
    assert seen == [want]
    for g, w in zip(got, want_out):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4)


@pytest.mark.parametrize("over,want", [(None, (64, 256, 256)), ({"tm": 32}, (32, 256, 256)),
                                       ({"tn": 384}, (64, 256, 256)),  # 384 does not divide N
                                       ({"tm": 128}, (64, 256, 256))])  # tm past M's rows
def test_gmm_wrapper_takes_the_table(monkeypatch, over, want):
    _fake_chip(monkeypatch, "gmm", over)
    seen = []
    _spy(monkeypatch, gmm, "_gmm_pallas", seen, lambda a, k: (a[8].tm, a[8].tk, a[8].tn))
    rng = np.random.default_rng(1)
    lhs = jnp.asarray(rng.standard_normal((64, 256)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((3, 256, 256)) / 16, jnp.float32)
    sizes = jnp.asarray([20, 0, 30], jnp.int32)
    out = gmm.gmm(lhs, rhs, sizes, impl="interpret")
    assert seen == [want]
    ref = gmm.ref_gmm(lhs, rhs, sizes)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-4)


def test_routing_and_attention_seams(monkeypatch):
    _fake_chip(monkeypatch, "routing", {"gather_rows": 256, "reduce_tokens": 64})
    assert routing._blocks(None) == routing.RoutingBlockSizes(256, 64)
    given = routing.RoutingBlockSizes(128, 8)
    assert routing._blocks(given) is given  # the caller's sizes win
    _fake_chip(monkeypatch, "routing", {"gather_rows": 200})  # not a legal SMEM block
    assert routing._blocks(None) == routing.RoutingBlockSizes()

    _fake_chip(monkeypatch, "attention", {"kv_pages_per_block": 3})
    seen = []
    _spy(monkeypatch, rpa.pallas_attention, "_make_kernel", seen, lambda a, k: k["block"])
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((3, 4, 128)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((1, 8, 4, 16, 128)), jnp.float32)
    meta = (jnp.asarray([40, 50], jnp.int32), jnp.asarray([[0, 1, 2, 3], [4, 5, 6, 7]], jnp.int32),
            jnp.asarray([0, 1, 3], jnp.int32), jnp.asarray([2], jnp.int32))
    out = rpa.ragged_paged_attention(q, kv, *meta, sm_scale=0.1, impl="interpret")
    assert [b.kv_pages_per_block for b in seen] == [3]
    ref = rpa.ref_ragged_paged_attention(q, kv, *meta, sm_scale=0.1)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-4)


# ----------------------------------------------------------------------------- the sweep


def _load_sweep():
    return load_script("benchmarks/sweep_block_sizes.py")


def test_sweep_choice_writing_and_refusal_off_tpu(tmp_path, capsys):
    sweep = _load_sweep()
    d = {"blocks": {}, "ms": 10.0, "matches": True}
    fast = {"blocks": {"tm": 256}, "ms": 9.0, "matches": True}
    assert sweep.choose([d, fast], 0.02) == {"tm": 256}
    assert sweep.choose([d, dict(fast, matches=False)], 0.02) == {}  # wrong output
    assert sweep.choose([d, dict(fast, ms=9.9)], 0.02) == {}  # within the margin
    assert sweep.choose([dict(d, matches=False), fast], 0.02) == {}  # no baseline

    path = tmp_path / "t.json"
    path.write_text(json.dumps({"device_kinds": {"TPU7x": {"gdn": {
        "overrides": {"k_heads_per_block": 2}, "timed": True, "source": "chip"}}}}))
    untimed = {"overrides": {}, "timed": False, "source": "compile sweep"}
    sweep.write_entries(path, "TPU7x", {"gdn": untimed, "gmm": untimed})
    kinds = json.loads(path.read_text())["device_kinds"]
    assert kinds["TPU7x"]["gdn"]["timed"] and kinds["TPU7x"]["gmm"] == untimed

    with pytest.raises(SystemExit) as e:
        sweep.main(["--only", "gdn", "--dry-run"])
    assert "--compile-only" in str(e.value.code)


def test_timed_sweep_in_interpret_mode_on_smoke_shapes(tmp_path):
    """The chip sweep's path on the CPU (--interpret: times mean nothing, nothing written):
    every routing candidate runs on every case and matches the default's output."""
    sweep = _load_sweep()
    table = tmp_path / "t.json"
    table.write_text('{"device_kinds": {}}')
    argv = ["--interpret", "--preset", "smoke", "--warmup", "0", "--iters", "1",
            "--table", str(table)]
    out = sweep.main(argv + ["--only", "routing"])
    assert out["device_kind"] == "cpu" and table.read_text() == '{"device_kinds": {}}'
    e = out["entries"]["routing"]
    assert e["timed"] is True and set(e["overrides"]) <= {"gather_rows", "reduce_tokens"}
    assert [c["blocks"] for c in e["candidates"]] == sweep.CANDIDATES["routing"]
    assert all(c["matches"] and c["ms"] > 0 for c in e["candidates"]), e["candidates"]
    assert "4 cases" in e["note"]
    for c in e["candidates"]:  # each case's ms, summing to the candidate's
        assert len(c["case_ms"]) == 4 and abs(sum(c["case_ms"].values()) - c["ms"]) < 1e-3
