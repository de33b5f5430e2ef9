"""Which weights get the MXU's native tiling (model_executor/weight_layout.py).

The effect on a compiled TPU step (no whole-stack weight copies, the 60-layer 397B step
fitting HBM) is checked in tests/tpu/test_dp_compile.py; here the selection rules and the CPU
behaviour (default layouts, values untouched).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.layout import Format
from jax.sharding import SingleDeviceSharding

from sglang_tpu_backend.config import load_model_config
from sglang_tpu_backend.model_executor.weight_layout import (
    OUTPUT_MAJOR_WEIGHTS,
    is_matmul_weight,
    native_tiling,
    place_weights,
    weight_formats,
)
from sglang_tpu_backend.models.param_shapes import param_shapes
from sglang_tpu_backend.model_loader.tiny_model import ASSET_DIR
from sglang_tpu_backend.planning import plan

# jax's layout API (Format, Layout) moves between versions: both jax legs.
pytestmark = pytest.mark.jax_versions


def test_native_tiling_packs_narrow_dtypes_into_taller_tiles():
    assert native_tiling(jnp.float32) == ((8, 128),)
    assert native_tiling(jnp.bfloat16) == ((16, 128), (2, 1))
    assert native_tiling(jnp.float8_e4m3fn) == ((32, 128), (4, 1))


def test_matmul_weight_rule():
    assert is_matmul_weight((15, 4096, 16384), jnp.bfloat16)
    assert is_matmul_weight((248320, 4096), jnp.bfloat16)
    assert not is_matmul_weight((15, 4096), jnp.bfloat16)  # norm scales: rank 1 per layer
    assert not is_matmul_weight((15, 8192, 4), jnp.bfloat16)  # conv taps: 4 columns
    assert not is_matmul_weight((15, 64, 4096), jnp.bfloat16)  # fewer rows than a tile column
    assert not is_matmul_weight((15, 4104, 4096), jnp.bfloat16)  # rows not whole 16-row tiles


def test_397b_formats_cover_dense_matmul_weights_not_experts():
    shapes = param_shapes(plan._load(str(plan.DEFAULT_CONFIG)), jnp.bfloat16, fp8_experts=True)
    where = SingleDeviceSharding(jax.devices()[0])
    formats = weight_formats(shapes, jax.tree.map(lambda _: where, shapes))
    tiled, plain = [], []
    for (path, s), f in zip(jax.tree_util.tree_leaves_with_path(shapes), jax.tree.leaves(formats)):
        (tiled if isinstance(f, Format) else plain).append((jax.tree_util.keystr(path), s))
    tiled_names = {n for n, _ in tiled}
    assert not any("experts" in n and "shared" not in n for n in tiled_names)
    for must in ("q_proj", "o_proj", "out_proj", "shared_expert"):
        assert any(must in n for n in tiled_names), must
    # The embedding and the head stay in the default tiling, which their gather and matmul
    # read (weight_layout's docstring); both are whole [V, H] leaves.
    plain_names = {n for n, _ in plain}
    assert {"['embed_tokens']", "['lm_head']"} <= plain_names
    # What else stays in the default layout is small: norms, conv taps, router, gates.
    dense_plain = sum(np.prod(s.shape) * s.dtype.itemsize for n, s in plain
                      if ("experts" not in n or "shared" in n)
                      and n not in ("['embed_tokens']", "['lm_head']"))
    dense_tiled = sum(np.prod(s.shape) * s.dtype.itemsize for _, s in tiled)
    assert dense_plain < 0.01 * dense_tiled


def test_output_major_weights_swap_the_two_minor_dims_only():
    shapes = param_shapes(plan._load(str(plan.DEFAULT_CONFIG)), jnp.bfloat16, fp8_experts=True)
    where = SingleDeviceSharding(jax.devices()[0])
    formats = weight_formats(shapes, jax.tree.map(lambda _: where, shapes))
    seen = set()
    for (path, s), f in zip(jax.tree_util.tree_leaves_with_path(shapes), jax.tree.leaves(formats)):
        if not isinstance(f, Format):
            continue
        name = path[-1].key
        order = f.layout.major_to_minor
        if name in OUTPUT_MAJOR_WEIGHTS:
            seen.add(name)
            assert order == (0, 2, 1), (jax.tree_util.keystr(path), order)
        else:
            assert order == tuple(range(len(s.shape))), (jax.tree_util.keystr(path), order)
    assert seen == set(OUTPUT_MAJOR_WEIGHTS)


def test_place_weights_on_cpu_keeps_default_layout_and_values():
    cfg = load_model_config(ASSET_DIR)
    params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype),
                          param_shapes(cfg, jnp.float32))
    where = SingleDeviceSharding(jax.devices()[0])
    placed = place_weights(params, jax.tree.map(lambda _: where, params))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(placed)):
        assert b.sharding == where
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
