"""``--dtype auto`` (the default) serves the checkpoint config's dtype as stated, bfloat16 when
it states none (SGLang on GPUs downcasts float32 to float16; TPUs have no fast float16)."""

from __future__ import annotations

import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

from sglang_tpu_backend.config import config_dtype, resolve_dtype  # noqa: E402
from sglang_tpu_backend.config import cache_storage_dtype  # noqa: E402
from sglang_tpu_backend.model_loader.tiny_model import default_model_path  # noqa: E402
from sglang_tpu_backend.server_args import ServerArgs  # noqa: E402


def checkpoint_saying(tmp_path, dtype: str | None, key: str = "dtype"):
    """The tiny checkpoint (weights linked, not copied) with its config stating ``dtype``
    under ``key`` in both the top level and ``text_config`` (None: no dtype at all)."""
    src = default_model_path()
    out = tmp_path / f"tiny-{dtype}-{key}"
    out.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    for d in (cfg, cfg["text_config"]):
        d.pop("dtype", None)
        d.pop("torch_dtype", None)
        if dtype is not None:
            d[key] = dtype
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_default_is_auto_and_the_embedded_model_is_bfloat16():
    assert ServerArgs().dtype == "auto"
    assert resolve_dtype("auto", default_model_path()) == "bfloat16"


@pytest.mark.parametrize("stated, served", [("bfloat16", "bfloat16"), ("float16", "float16"),
                                            ("float32", "float32"), (None, "bfloat16")])
def test_auto_serves_the_stated_dtype(tmp_path, stated, served):
    path = checkpoint_saying(tmp_path, stated)
    assert resolve_dtype("auto", path) == served
    assert resolve_dtype("float16", path) == "float16"  # an explicit dtype is kept


def test_config_dtype_keys():
    assert config_dtype({"torch_dtype": "float32"}) == "float32"
    assert config_dtype({"text_config": {"dtype": "bfloat16"}, "dtype": "float32"}) == "bfloat16"
    assert config_dtype({"torch_dtype": "torch.float16"}) == "float16"
    assert config_dtype({}) is None


@pytest.mark.parametrize("stated, served", [("float32", "float32"), ("bfloat16", "bfloat16")])
def test_engine_loads_and_reports_the_resolved_dtype(tmp_path, stated, served):
    from sglang_tpu_backend.engine import Engine

    path = checkpoint_saying(tmp_path, stated, key="torch_dtype")
    eng = Engine(model_path=str(path), max_running_requests=2, context_length=64,
                 chunked_prefill_size=32, skip_warmup=True, start_loop=False)
    try:
        assert eng.get_server_info()["dtype"] == served
        leaves = jax.tree_util.tree_leaves(eng.runner.params)
        assert str(max(leaves, key=lambda x: x.size).dtype) == served
        # The caches of a 16-bit model are f32 on a CPU (config.cache_storage_dtype).
        stored = cache_storage_dtype(jnp.dtype(served), jax.default_backend())
        assert eng.runner.cache.kv_pages.dtype == stored == eng.runner.cache.conv_state.dtype
    finally:
        eng.shutdown()
