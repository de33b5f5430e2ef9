"""TPU7x compile tests of the GDN kernels (kernels/gdn_kernels.py) through kernels/gdn.py (the
decode kernel's rows per grid step also for v5e).

Each case lowers ``gated_delta_net(..., impl="pallas")`` with Mosaic for one Ironwood
TensorCore from abstract arrays, the layer passed as a traced scalar (as under the model's
``lax.scan``) and the stacked states donated, and records VMEM use.

The conv state has ``conv_state_rows(K) = 4`` rows per slot (3 taps padded to a power of
two): XLA:TPU's default layout of ``[Lyr, S, 4, C]`` is row-major, the layout the kernels take,
while for 3 rows it would make S second-minor and copy the whole stacked state in and out of
every step. The 397B cases assert that no such copy exists (``_assert_states_not_copied``).
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

from sglang_tpu_backend.kernels import gdn, gdn_verify  # noqa: E402
from sglang_tpu_backend.kernels.gdn_common import conv_state_rows  # noqa: E402
from sglang_tpu_backend.kernels.tpu_compile import (abstract, compile_for_tpu,  # noqa: E402
                                                   core_mesh)

BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
TINY = dict(hk=2, hv=4, d=32, layers=6, slots=16)  # C = 2*2*32 + 4*32 = 256
QWEN = dict(hk=16, hv=64, d=128, layers=45, slots=512)  # Qwen3.5-397B per chip, C = 12288


def _shapes(model, *, tokens, reqs, state_dtype, slots=None):
    """(shape, dtype) of gated_delta_net's 12 arrays, then the layer scalar."""
    hk, hv, d, lyr = model["hk"], model["hv"], model["d"], model["layers"]
    s = slots or model["slots"]
    k, c = 4, 2 * hk * d + hv * d
    return [((tokens, c), BF16), ((tokens, hv), BF16), ((tokens, hv), BF16), ((c, k), BF16),
            ((hv,), F32), ((hv,), F32), ((lyr, s, conv_state_rows(k), c), BF16),
            ((lyr, s, hv, d, d), state_dtype), ((reqs + 1,), I32), ((reqs,), I32),
            ((reqs,), I32), ((1,), I32), ((), I32)]


def _step(model, decode, block_sizes=None):
    def step(*a):
        return gdn.gated_delta_net(*a[:12], num_k_heads=model["hk"], decode=decode,
                                   layer=a[12], impl="pallas", block_sizes=block_sizes)

    return step


def _compile(mesh, model, *, tokens, reqs, decode, state_dtype, slots=None, block_sizes=None):
    shapes = _shapes(model, tokens=tokens, reqs=reqs, state_dtype=state_dtype, slots=slots)
    args = [abstract(shape, dtype, mesh) for shape, dtype in shapes]
    return compile_for_tpu(_step(model, decode, block_sizes), args, mesh, donate_argnums=(6, 7))


def _assert_states_not_copied(report, model, state_dtype, slots=None):
    """Neither stacked state is relaid out around the kernel (no copy of it in the HLO, temp
    memory below one copy of either) and both are aliased in place."""
    hv, d, lyr = model["hv"], model["d"], model["layers"]
    s = slots or model["slots"]
    c = 2 * model["hk"] * d + hv * d
    conv_bytes = lyr * s * conv_state_rows(4) * c * 2
    rec_bytes = lyr * s * hv * d * d * jnp.dtype(state_dtype).itemsize
    assert report.memory["temp_size_in_bytes"] < min(conv_bytes, rec_bytes), report.memory
    state_shape = f"[{lyr},{s},{conv_state_rows(4)},{c}]"
    assert not any(" copy(" in line and state_shape in line for line in report.hlo.splitlines())
    assert report.memory["alias_size_in_bytes"] >= conv_bytes + rec_bytes, report.memory


@pytest.mark.parametrize("decode,tokens", [(True, 16), (False, 64)])
def test_tiny_model(mesh, record, decode, tokens):
    report = _compile(mesh, TINY, tokens=tokens, reqs=16, decode=decode, state_dtype=F32)
    record(f"gdn tiny {'decode' if decode else 'chunked'} T={tokens} fp32 state", report)


@pytest.mark.parametrize("state_dtype,slots", [(BF16, None), (F32, 128)], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tokens", [64, 512])
def test_qwen_decode(mesh, record, tokens, state_dtype, slots):
    report = _compile(mesh, QWEN, tokens=tokens, reqs=tokens, decode=True,
                      state_dtype=state_dtype, slots=slots)
    record(f"gdn 397B decode T=R={tokens} {jnp.dtype(state_dtype).name} state", report)
    _assert_states_not_copied(report, QWEN, state_dtype, slots)


@functools.lru_cache(maxsize=None)
def _v5e_mesh():
    return core_mesh("v5e:2x2")


# Decode rows per grid step (GdnBlockSizes.rows_per_step): 1, 3 (T = 64 not a multiple: the
# wrapper pads), 8 (the default), 16; on TPU7x and on v5e (16 GiB of HBM: 64 state slots).
@pytest.mark.parametrize("chip", ["tpu7x", "v5e"])
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
@pytest.mark.parametrize("model,state_dtype,slots", [(TINY, F32, None), (QWEN, BF16, None),
                                                     (QWEN, F32, 128)],
                         ids=["tiny", "397B-bf16", "397B-fp32"])
def test_decode_rows_per_step(mesh, record, chip, rows, model, state_dtype, slots):
    m = mesh if chip == "tpu7x" else _v5e_mesh()
    slots = slots if chip == "tpu7x" or model is TINY else 64
    report = _compile(m, model, tokens=64, reqs=64, decode=True, state_dtype=state_dtype,
                      slots=slots, block_sizes=gdn.GdnBlockSizes(rows_per_step=rows))
    record(f"gdn {chip} {'397B' if model is QWEN else 'tiny'} decode T=R=64 rb={rows} "
           f"{jnp.dtype(state_dtype).name} state", report)
    if model is QWEN:
        _assert_states_not_copied(report, QWEN, state_dtype, slots)


@pytest.mark.parametrize("state_dtype,slots", [(BF16, None), (F32, 128)], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tokens", [1024, 2048])
def test_qwen_chunked(mesh, record, tokens, state_dtype, slots):
    report = _compile(mesh, QWEN, tokens=tokens, reqs=64, decode=False, state_dtype=state_dtype,
                      slots=slots)
    record(f"gdn 397B chunked T={tokens} R=64 {jnp.dtype(state_dtype).name} state", report)
    _assert_states_not_copied(report, QWEN, state_dtype, slots)


def _verify_step(model):
    def step(*a):
        return gdn_verify.gated_delta_net_verify(*a[:8], *a[9:12], num_k_heads=model["hk"],
                                                 layer=a[12], impl="pallas")

    return step


@pytest.mark.parametrize("model,reqs,state_dtype,slots", [
    (TINY, 16, F32, None), (QWEN, 64, BF16, None), (QWEN, 64, F32, 128)],
    ids=["tiny", "397B-bf16", "397B-fp32"])
def test_verify(mesh, record, model, reqs, state_dtype, slots):
    # Verify mode, k = 3 drafts: T = 4 R tokens. The stacked states are only read (by the
    # kernel's DMA): no copy of either, nothing aliased.
    draft_len = 3
    shapes = _shapes(model, tokens=reqs * (draft_len + 1), reqs=reqs, state_dtype=state_dtype,
                     slots=slots)
    args = [abstract(shape, dtype, mesh) for shape, dtype in shapes]
    report = compile_for_tpu(_verify_step(model), args, mesh)
    record(f"gdn verify {model['layers']} layers R={reqs} k={draft_len} "
           f"{jnp.dtype(state_dtype).name} state", report)
    if model is QWEN:
        s, c = slots or model["slots"], 2 * model["hk"] * model["d"] + model["hv"] * model["d"]
        conv_bytes = model["layers"] * s * conv_state_rows(4) * c * 2
        assert report.memory["temp_size_in_bytes"] < conv_bytes, report.memory
        assert not any(" copy(" in line and f"[{model['layers']},{s}," in line
                       for line in report.hlo.splitlines())


def test_commit_updates_states_in_place(mesh, record):
    # 397B per chip, bf16 state, R = 64 requests, k = 3: commit_states runs the commit kernel
    # once per layer (the accepted positions again, from the slot) and writes the R slots of
    # every layer into the donated stacked states in place, without copying either.
    hk, hv, d, lyr, s = QWEN["hk"], QWEN["hv"], QWEN["d"], QWEN["layers"], QWEN["slots"]
    reqs, n, c = 64, 4, 2 * hk * d + hv * d
    shapes = [((lyr, s, conv_state_rows(4), c), BF16), ((lyr, s, hv, d, d), BF16),
              ((lyr, reqs, 3 + n, c), BF16), ((lyr, reqs, n, hv), BF16),
              ((lyr, reqs, n, hv), BF16), ((reqs,), jnp.bool_), ((lyr, c, 4), BF16),
              ((lyr, hv), F32), ((lyr, hv), F32), ((reqs,), I32), ((reqs,), I32)]
    args = [abstract(shape, dtype, mesh) for shape, dtype in shapes]

    def commit(*a):
        return gdn_verify.commit_states(*a, num_k_heads=hk, impl="pallas")

    report = compile_for_tpu(commit, args, mesh, donate_argnums=(0, 1))
    m = report.memory
    gib = {k: m[f"{k}_size_in_bytes"] / 2**30 for k in ("argument", "temp", "output", "alias")}
    print(f"\ngdn commit 397B R={reqs}, GiB: " + ", ".join(f"{k} {v:.3f}" for k, v in gib.items()))
    record(f"gdn commit 397B R={reqs} k={n - 1} bf16 state", report)
    _assert_states_not_copied(report, QWEN, BF16)


@pytest.mark.parametrize("tokens", [2048, 4096])
def test_qwen_chunked_into_out_proj(mesh, record, tokens):
    # The model's GDN block past the kernel: gated RMSNorm, then out_proj. XLA:TPU fuses the
    # output's token gather into the matmul; gathering o[:, chunk, :, pos % L] straight from
    # the kernel's [nb, N, hb, L, Dv] output made a SparseCore gather that fails for tpu7x above
    # 1,024 tokens (gather_emitter RET_CHECK: operand and output tilings differ).
    from sglang_tpu_backend.models.layers import gated_rms_norm

    hv, d = QWEN["hv"], QWEN["d"]
    shapes = _shapes(QWEN, tokens=tokens, reqs=64, state_dtype=BF16) + [
        ((tokens, hv, d), BF16), ((d,), BF16), ((hv * d, 4096), BF16)]
    args = [abstract(shape, dtype, mesh) for shape, dtype in shapes]

    def block(*a):
        o, cs, rs = _step(QWEN, False)(*a[:13])
        y = gated_rms_norm(o, a[13], a[14], 1e-6).reshape(tokens, hv * d)
        return y @ a[15], cs, rs

    report = compile_for_tpu(block, args, mesh, donate_argnums=(6, 7))
    record(f"gdn 397B chunked T={tokens} R=64 + norm + out_proj", report)
    _assert_states_not_copied(report, QWEN, BF16)
