"""host_inputs: a tree of numpy arrays packed into one i32 buffer and cut back on the device."""

import dataclasses

import jax
import numpy as np
import pytest

from sglang_tpu_backend.model_executor import host_inputs
from sglang_tpu_backend.model_executor.forward_batch import ForwardBatch, ForwardMode


def test_round_trip_keeps_every_leaf_bit_for_bit():
    rng = np.random.default_rng(0)
    fb = ForwardBatch(*(rng.integers(-9, 9, s).astype(np.int32) for s in
                        [(8,), (8,), (3,), (2,), (2, 5), (2,), (1,), (2,)]),
                      mode=ForwardMode.DECODE)
    extra = {"f": np.array([1.5, -0.0, np.inf, np.nan], np.float32),
             "u": np.array([0, 2**32 - 1], np.uint32), "b": np.array([[True, False]]),
             "none": None}
    tree = (fb, extra)
    got = host_inputs.to_device(tree, jax.devices()[0])
    assert got[0].mode == ForwardMode.DECODE and got[1]["none"] is None
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(got)):
        assert b.dtype == a.dtype and b.shape == a.shape
        np.testing.assert_array_equal(np.asarray(b).view(np.uint8), a.view(np.uint8))
    buf, layout = host_inputs.pack(tree)
    assert buf.dtype == np.int32 and layout.num_words == 8 + 8 + 3 + 2 + 10 + 2 + 1 + 2 + 4 + 2 + 2
    same = dataclasses.replace(fb, input_ids=fb.input_ids + 1)  # values do not change the layout
    assert host_inputs.pack((same, extra))[1] == layout


def test_other_dtypes_are_refused():
    with pytest.raises(TypeError, match="int64"):
        host_inputs.pack({"x": np.zeros(3, np.int64)})
