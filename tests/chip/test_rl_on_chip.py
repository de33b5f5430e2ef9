"""SGLang's RL calls on a TPU chip, in-process: a refit from tensors serves the new weights as an
engine started on them does, and a release frees the chip's memory, a resume gives back the
same outputs without compiling anything.

Runs on the TPU leg (``tests/run_tpu.sh engine``); skipped everywhere else (marker ``chip``).
The CPU versions of these checks (HTTP, the distributed path, refusals) are in
``tests/engine/test_rl_surface.py``; here what only a chip can show: the update's arrays land
in HBM with the engine's TPU layouts, and the freed bytes are the chip's own
(``Device.memory_stats``), not Python's count of live arrays.
"""

from __future__ import annotations

import gc

import jax
import numpy as np
import pytest

from tests.engine.conftest import ENGINE_ARGS
from tests.engine.engine_runs import run_each, tokens_and_logprobs

pytestmark = pytest.mark.chip


def _engine(**kw):
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.server_args import ServerArgs

    return Engine(ServerArgs(**{**ENGINE_ARGS, **kw}))


def _outputs(eng):
    eng.flush_cache()  # prefill from scratch each time
    return tokens_and_logprobs(run_each(eng))


def _hbm_in_use() -> int:
    gc.collect()
    return jax.devices()[0].memory_stats()["bytes_in_use"]


def _engine_bytes(runner) -> int:
    """Bytes of the device arrays the runner holds (params, KV pages and GDN states, sampler)."""
    s = runner.sampler
    return sum(a.nbytes for a in jax.tree.leaves(
        [runner.params, runner.cache, s.counts, s.prompt_mask, s.last_tokens]))


def test_refit_release_and_resume_on_the_chip(tmp_path):
    from sglang_tpu_backend.model_executor.compile_cache import CompileCounter
    from sglang_tpu_backend.model_loader.checkpoint_io import read_checkpoint
    from sglang_tpu_backend.model_loader.tiny_model import write_random_model

    assert jax.default_backend() == "tpu"
    ckpt_b = write_random_model(tmp_path / "b", seed=1)
    eng_b = _engine(model_path=str(ckpt_b))
    try:
        want_b = _outputs(eng_b)
    finally:
        eng_b.shutdown()
    del eng_b  # its arrays leave the chip: the release's count below is this engine's alone
    gc.collect()
    eng = _engine()
    ckpt_a = eng.args.model_path  # the embedded tiny model (ServerArgs resolves the default)
    try:
        want_a = _outputs(eng)
        assert want_a != want_b
        # Refit to B from numpy arrays: the same programs on the same chip, so equal outputs.
        # The first refit may compile JAX's relayout of a host array into a weight's tiled
        # layout (``_device_put_reshard``, one small program per leaf shape, measured: 17 on
        # the tiny model); no serving program compiles, and a second refit compiles nothing.
        counter = CompileCounter()
        res = eng.update_weights_from_tensor(read_checkpoint(ckpt_b), weight_version="b")
        assert res["success"], res
        assert _outputs(eng) == want_b
        serving = [n for n in counter.compiled_names if "_device_put_reshard" not in n]
        assert serving == [], f"the update recompiled serving programs: {serving}"
        counter = CompileCounter()
        res = eng.update_weights_from_tensor(read_checkpoint(ckpt_a), weight_version="a")
        assert res["success"], res
        assert _outputs(eng) == want_a
        assert counter.lowerings == 0 and counter.backend_compiles == 0, "a refit recompiled"
        res = eng.update_weights_from_tensor(read_checkpoint(ckpt_b), weight_version="b")
        assert res["success"] and _outputs(eng) == want_b

        # Release everything: the chip's own count of bytes in use falls by >= 80% of what
        # the engine held; resume: the same outputs, nothing compiled.
        before, owned, in_use0 = _outputs(eng), _engine_bytes(eng.runner), _hbm_in_use()
        res = eng.release_memory_occupation()
        in_use1 = _hbm_in_use()
        print(f"\nrelease on the chip: HBM in use {in_use0} -> {in_use1} bytes; the engine "
              f"held {owned}, freed {res['freed_bytes']}")
        assert res["tags"] == ["kv_cache", "weights"]
        assert in_use0 - in_use1 >= 0.8 * owned > 0
        counter = CompileCounter()
        eng.resume_memory_occupation()
        assert _outputs(eng) == before
        assert counter.lowerings == 0 and counter.backend_compiles == 0, "waking recompiled"
        np.testing.assert_array_equal(np.asarray(eng.runner.params["norm"]),
                                      read_checkpoint(ckpt_b)[
                                          "model.language_model.norm.weight"].astype(np.float32))
    finally:
        eng.shutdown()
