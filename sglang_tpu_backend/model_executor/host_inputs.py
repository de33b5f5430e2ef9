"""A step's numpy inputs on the device in one host-to-device copy.

Every numpy argument of a jitted call is a host-to-device transfer of its own. On a TPU each
costs host time, and a decode step passed ~27 small arrays (the ``ForwardBatch``, the
in-flight input rows, the ``SamplingInputs``, some of them twice) to 4 programs: on a v5e
that dispatch took 3.6 ms of host time for one request, against 0.7 ms of device work. Here a tree of numpy
arrays (32-bit and bool leaves) is packed into one i32 buffer, copied once, and cut back into
the tree's arrays inside the program that uses them: the step's input ids are resolved
(in-flight decode rows) as the batch is unpacked, and the sampler unpacks its inputs itself,
so a decode step is two copies and three programs (unpack the batch, forward, sample).

The packing layout (``PackLayout``: the tree's structure, each leaf's shape, dtype and word
offset) is the unpack program's static argument: one program per step bucket and sampler
variant, compiled at warm-up with the rest (warm-up places its dummy inputs the same way).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_KINDS = {np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.float32), np.dtype(np.bool_)}


@dataclasses.dataclass(frozen=True)
class PackLayout:
    """Where each leaf of a packed tree lives in the i32 buffer (hashable: a static arg).

    treedef: the tree's structure (static fields such as ``ForwardBatch.mode`` included).
    leaves: per leaf (shape, dtype name, first word); a leaf of n elements takes n words.
    num_words: buffer length.
    """

    treedef: Any
    leaves: tuple[tuple[tuple[int, ...], str, int], ...]
    num_words: int


def pack(tree: Any) -> tuple[np.ndarray, PackLayout]:
    """(i32[num_words] buffer, layout) of a tree of numpy arrays of 32-bit or bool dtypes."""
    arrays, treedef = jax.tree.flatten(tree)
    leaves, offset = [], 0
    for a in arrays:
        a = np.asarray(a)
        if a.dtype not in _KINDS:
            raise TypeError(f"cannot pack a {a.dtype} leaf (32-bit and bool leaves only)")
        leaves.append((a.shape, a.dtype.name, offset))
        offset += a.size
    buf = np.empty(max(offset, 1), np.int32)
    for a, (_, _, start) in zip(arrays, leaves):
        a = np.asarray(a)
        words = a.astype(np.int32) if a.dtype == np.bool_ else a.view(np.int32)
        buf[start:start + a.size] = words.reshape(-1)
    return buf, PackLayout(treedef, tuple(leaves), max(offset, 1))


@dataclasses.dataclass(frozen=True)
class Packed:
    """A packed tree on the device, for a jitted program that unpacks it itself
    (``unpack_tree`` inside its trace): buf i32[num_words], layout its static argument."""

    buf: jax.Array
    layout: PackLayout


def unpack_tree(buf: jax.Array, layout: PackLayout) -> Any:
    """The tree ``pack`` laid out in ``buf`` (i32[num_words]); traceable (call it inside the
    program that uses the tree, or through ``unpack``)."""
    out = []
    for shape, dtype, start in layout.leaves:
        n = int(np.prod(shape, dtype=np.int64))
        words = jax.lax.slice(buf, (start,), (start + n,)).reshape(shape)
        if dtype == "bool":
            out.append(words != 0)
        elif dtype == "int32":
            out.append(words)
        else:
            out.append(jax.lax.bitcast_convert_type(words, jnp.dtype(dtype)))
    return jax.tree.unflatten(layout.treedef, out)


unpack = jax.jit(unpack_tree, static_argnums=(1,))


def to_device(tree: Any, device: Any) -> Any:
    """``tree`` (numpy leaves) on ``device`` through one host-to-device copy."""
    buf, layout = pack(tree)
    return unpack(jax.device_put(buf, device), layout)


def packed(tree: Any, device: Any) -> Packed:
    """``tree`` (numpy leaves) copied to ``device`` as one buffer, still packed."""
    buf, layout = pack(tree)
    return Packed(jax.device_put(buf, device), layout)
