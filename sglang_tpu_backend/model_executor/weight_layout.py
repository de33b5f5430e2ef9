"""How dense weights are laid out in TPU HBM.

XLA:TPU stores a jit argument in its *default* tiled layout unless told otherwise; for a bf16
matrix that is ``T(8,128)(2,1)``. Its matmuls, however, read a bf16 operand in the MXU's native
``T(16,128)(2,1)`` tiles (``T(32,128)(4,1)`` for 8-bit, ``T(8,128)`` for 32-bit). Under the
layer scan a stacked weight ``[groups, K, N]`` in the default layout is therefore copied into
the native one on every step: the whole stack, for every matmul weight, as a temporary (about
0.24 GiB per layer for Qwen3.5-397B, enough to push the 60-layer step past a TensorCore's HBM).

Storing the dense weights in the native tiling from the start removes those copies:
:func:`weight_formats` says, per parameter leaf, which layout it lives in; the runner places
real weights with it (:func:`place_weights`), and the weight-free compiles
(``step_compile.py``) declare the same formats on their abstract params, so what is compiled
here is what runs on a TPU. Routed-expert leaves are left alone: the grouped-matmul kernels
read them in the default layout. Off TPU everything stays in the backend's default layout.

Tiling is not the whole story: for two weights XLA:TPU also wants the two minor dimensions
swapped (stored output-major, ``[groups, N, K]`` in memory for a logical ``[groups, K, N]``):
attention's ``q_proj`` (its output is split per head into query and gate) and GDN's
``in_proj_z`` (read per value head by the gated norm). In the input-major layout the compiled
397B decode step relays out each layer's slice of both on the SparseCore on every step (one
read and one write of 128 + 64 MiB per layer group, found in the compiled HLO as
``sparse-core-data-format`` calls); stored output-major there are none
(``tests/tpu/test_dp_compile.py`` checks). :data:`OUTPUT_MAJOR_WEIGHTS` names them.

The embedding table and the LM head ([V, H], outside the layer scan) are the exception the
other way (:data:`DEFAULT_LAYOUT_WEIGHTS`): the embedding's gather and the head's matmul read
them in the default ``T(8,128)(2,1)`` tiling. In the native one, the v5e and v6e compiles of
the 397B step copied each whole on every step (2 GiB apiece at its 248K vocabulary, and
libtpu aborted compiling the gather of the copy: ``gather_emitter`` check failure), and the
TPU7x compile relaid the head inside its matmul (``tests/tpu/test_model_compile.py``).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental.layout import Format, Layout
from jax.sharding import Sharding

LANES = 128  # minor-dim tile of every TPU layout
OUTPUT_MAJOR_WEIGHTS = ("q_proj", "in_proj_z")  # leaf names stored [.., N, K] in memory
DEFAULT_LAYOUT_WEIGHTS = ("embed_tokens", "lm_head")  # [V, H] leaves kept in the default tiling


def native_tiling(dtype: Any) -> tuple[tuple[int, int], ...]:
    """The MXU's operand tiling for ``dtype``: (8 * packing, 128) tiles, packed ``packing``
    elements per 32-bit word."""
    packing = 4 // np.dtype(dtype).itemsize
    tiles: tuple[tuple[int, int], ...] = ((8 * packing, LANES),)
    return tiles + ((packing, 1),) if packing > 1 else tiles


def is_matmul_weight(shape: tuple[int, ...], dtype: Any) -> bool:
    """A dense weight the model multiplies by: rank >= 2 with whole native tiles (rows a multiple
    of the tile height and at least 128, columns a multiple of 128). Norm scales, biases, conv
    taps and tiny matrices keep the default layout."""
    if len(shape) < 2 or np.dtype(dtype).itemsize not in (1, 2, 4):
        return False
    rows = native_tiling(dtype)[0][0]
    return shape[-2] >= LANES and shape[-2] % rows == 0 and shape[-1] % LANES == 0


def is_routed_expert(path) -> bool:
    """Whether a param-tree path (``tree_map_with_path``) is a routed-expert leaf."""
    return any(getattr(k, "key", None) == "experts" for k in path)


def weight_format(shape: tuple[int, ...], dtype: Any, sharding: Sharding, *,
                  output_major: bool = False) -> Format | Sharding:
    """``Format(native tiling, sharding)`` for a replicated matmul weight, else ``sharding``
    unchanged; ``output_major`` swaps the two minor dimensions in memory (the array's logical
    shape is unchanged). Split weights (tensor-parallel heads) keep the default layout: XLA:TPU
    does not take a caller's layout for a sharded argument of an SPMD program (it reports a
    layout override), and a device copies only its 1/tp share of them."""
    if not is_matmul_weight(shape, dtype) or not sharding.is_fully_replicated:
        return sharding
    order = list(range(len(shape)))
    if output_major:
        order[-2:] = order[-1], order[-2]
    layout = Layout(major_to_minor=tuple(order), tiling=native_tiling(dtype))
    return Format(layout, sharding)


def _leaf_name(path) -> str | None:
    return getattr(path[-1], "key", None) if path else None


def weight_formats(params: Any, shardings: Any) -> Any:
    """Per leaf of ``params`` (arrays or ShapeDtypeStructs): its :func:`weight_format`, with
    routed-expert leaves and those named in :data:`DEFAULT_LAYOUT_WEIGHTS` left at
    ``shardings``' default layout and the leaves named in :data:`OUTPUT_MAJOR_WEIGHTS`
    output-major. ``shardings`` mirrors params."""
    def fmt(path, x, s):
        if is_routed_expert(path) or _leaf_name(path) in DEFAULT_LAYOUT_WEIGHTS:
            return s
        return weight_format(x.shape, x.dtype, s,
                             output_major=_leaf_name(path) in OUTPUT_MAJOR_WEIGHTS)

    return jax.tree_util.tree_map_with_path(fmt, params, shardings)


def uses_native_layouts(sharding: Sharding) -> bool:
    """Only TPU backends take tiled layouts; elsewhere weights keep the default layout."""
    return next(iter(sharding.device_set)).platform == "tpu"


def weight_target(a: jax.Array) -> Format | Sharding:
    """Where ``jax.device_put`` puts a host copy of the placed weight ``a`` so that it lands as
    ``a`` did in ``place_weights``: its format (sharding + native tiling) on TPU, its sharding
    elsewhere (there a format would route the copy through a resharding program)."""
    return a.format if uses_native_layouts(a.sharding) else a.sharding


def place_weights(params: Any, shardings: Any) -> Any:
    """``params`` on their devices (``shardings`` mirrors the tree), matmul weights in the
    native tiling on TPU. Committed arrays carry their layout into every jit that takes them."""
    leaves = jax.tree.leaves(shardings)
    if leaves and uses_native_layouts(leaves[0]):
        shardings = weight_formats(params, shardings)
    return jax.device_put(params, shardings)
