"""Static geometry and block sizes of the GDN Pallas kernels (``kernels/gdn_kernels.py``,
``kernels/gdn_verify_kernel.py``): head blocking, decode rows per grid step, VMEM estimates.

Dimension letters as in ``kernels/gdn.py``; nb head blocks of kb qk heads and hb = kb * Hv / Hk
value heads; cb = 2 * kb * Dk + hb * Dv block channels; rb decode rows per grid step.
"""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

_LANES = 128
_VMEM_MIN = 16 << 20  # the smallest default scoped VMEM limit (v5e)
_VMEM_MAX = 60 << 20  # under TPU7x's 64 MiB per TensorCore (v5e has 128 MiB)
DEFAULT_ROWS_PER_STEP = 8  # decode rows per grid step, unless VMEM or T caps it
_DECODE_VMEM_BUDGET = 12 << 20  # the default rb keeps the decode estimate under this
# The decode kernel's default head block holds at least this much recurrent state. A decode
# row of a head block has a fixed cost (its conv, norms and gates, its DMAs' issue and waits)
# beside its state's traffic; on a v5e at 397B shapes, 64 requests, a bf16 state in blocks of
# 1 qk head (128 KiB) took 1.479 ms and in blocks of 2 (256 KiB) 1.240 ms, side by side,
# while an f32 state, 256 KiB at 1 qk head, took 1.680 / 1.706 ms at 1 / 2 (waited-for
# calls, sixth session of 2026-12-06).
DECODE_STATE_BLOCK_BYTES = 256 << 10
CHUNK_BLOCK_VALUE_HEADS = 16  # value heads of the chunk kernel's default head block, at least


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static shapes of one call: heads, head dims, conv taps, head blocking, chunk length,
    decode rows per grid step."""

    Hk: int
    Hv: int
    Dk: int
    Dv: int
    K: int
    kb: int  # qk heads per head block
    L: int  # chunk length (1 for decode)
    rb: int = 1  # decode rows per grid step (the decode kernel only)

    @property
    def rep(self):  # value heads per qk head
        return self.Hv // self.Hk

    @property
    def hb(self):  # value heads per head block
        return self.kb * self.rep

    @property
    def nb(self):  # head blocks
        return self.Hk // self.kb

    @property
    def C(self):
        return 2 * self.Hk * self.Dk + self.Hv * self.Dv

    @property
    def cb(self):  # channels of one head block: [q_j | k_j | v_j]
        return 2 * self.kb * self.Dk + self.hb * self.Dv

    @property
    def ctx_rows(self):  # P: conv context rows above a chunk in the extended buffer
        return -(-(self.K - 1) // 8) * 8

    def conv_segments(self, j):
        """(channel offset in C, offset in the block, width) of head block j's conv channels.

        One segment (all of C) for a single head block; otherwise q_j, k_j, v_j, whose
        offsets and widths are multiples of 128 lanes (checked by :func:`block_error`).
        """
        if self.nb == 1:
            return [(0, 0, self.C)]
        qk, vw = self.kb * self.Dk, self.hb * self.Dv
        lane = lambda x: pl.multiple_of(x, _LANES)  # noqa: E731 (true: qk, vw, Hk*Dk % 128 == 0)
        return [(lane(j * qk), 0, qk), (lane(self.Hk * self.Dk + j * qk), qk, qk),
                (lane(2 * self.Hk * self.Dk + j * vw), 2 * qk, vw)]


def block_error(num_k_heads, num_v_heads, dk, dv, kb):
    """Why ``kb`` qk heads per block cannot tile these heads (None if it can)."""
    if kb < 1 or num_k_heads % kb:
        return "k_heads_per_block must divide num_k_heads"
    v_width = kb * (num_v_heads // num_k_heads) * dv
    if kb != num_k_heads and ((kb * dk) % _LANES or v_width % _LANES):
        return ("k_heads_per_block must give q/k/v channel widths that are multiples of 128 "
                "lanes (kb*Dk, kb*Hv/Hk*Dv), or be num_k_heads")
    return None


def _aligned_blocks(num_k_heads, num_v_heads, dk, dv):
    """The legal k_heads_per_block values, ascending (``block_error`` None)."""
    return [kb for kb in range(1, num_k_heads + 1)
            if block_error(num_k_heads, num_v_heads, dk, dv, kb) is None]


def default_k_heads_per_block(num_k_heads, num_v_heads, dk, dv):
    """The smallest lane-aligned head block (1 qk head at 397B shapes), else all heads."""
    return _aligned_blocks(num_k_heads, num_v_heads, dk, dv)[0]


def default_chunk_k_heads_per_block(num_k_heads, num_v_heads, dk, dv):
    """The chunk kernel's head block: the smallest lane-aligned one of at least
    ``CHUNK_BLOCK_VALUE_HEADS`` value heads (4 qk heads at 397B shapes), else the largest
    lane-aligned one (all heads when D < 128). Fewer, fatter grid steps: its matmuls are
    batched over the block's heads, so a step's fixed cost is shared; on a v5e at 397B
    shapes, 1 / 2 / 4 qk heads took 6.647 / 6.277 / 6.096 ms (the kernel before its direct
    column reads and three-pass inverse), and v5e issue cycles of the op are 5.26M / 4.35M /
    4.07M with them."""
    legal = _aligned_blocks(num_k_heads, num_v_heads, dk, dv)
    rep = num_v_heads // num_k_heads
    big = [kb for kb in legal if kb * rep >= CHUNK_BLOCK_VALUE_HEADS]
    return big[0] if big else legal[-1]


def default_decode_k_heads_per_block(num_k_heads, num_v_heads, dk, dv, state_bytes):
    """The smallest lane-aligned head block whose recurrent state block is at least
    ``DECODE_STATE_BLOCK_BYTES`` (at 397B shapes: 1 qk head with an f32 state, 2 with bf16),
    else the largest lane-aligned one (all heads when D < 128)."""
    legal = _aligned_blocks(num_k_heads, num_v_heads, dk, dv)
    rep = num_v_heads // num_k_heads
    big = [kb for kb in legal if kb * rep * dk * dv * state_bytes >= DECODE_STATE_BLOCK_BYTES]
    return big[0] if big else legal[-1]


def chunk_vmem_limit(geom):
    """Scoped VMEM limit of the chunk kernel, or None for the compiler's default (16 MiB on
    v5e, 32 MiB on TPU7x) when that suffices.

    Estimate: ~30 f32 [L, max(L, 128)] tiles per value head of the block (its blocks, scratch
    and the batched delta rule's temporaries; the v5e compile reports at 397B shapes, L=64,
    D=128, bf16 activations: 2.9, 5.3, 10.2, 19.9, 40.2 MiB at kb = 1, 2, 4, 8, 16; with f32
    activations, before the direct column reads, 3.3 to 58.8 MiB), with 25% headroom, capped
    at 60 MiB.
    """
    need = 1.25 * geom.hb * 30 * geom.L * max(geom.L, _LANES) * 4
    return None if need <= _VMEM_MIN else int(min(need, _VMEM_MAX))


# ----------------------------------------------------------------------------- decode rows


def _tile(rows, cols, nbytes):
    """Bytes of a [rows, cols] VMEM buffer padded to (8 * 4 / nbytes, 128) tiles."""
    sub = 8 * max(1, 4 // nbytes)
    return -(-rows // sub) * sub * (-(-cols // _LANES) * _LANES) * nbytes


def decode_vmem_bytes(geom, rb, state_bytes, x_bytes):
    """Estimated VMEM of the decode kernel at rb rows per grid step, in bytes.

    Per row, twice (double buffer): the state scratch (conv state [4, cb] in x_bytes, the
    recurrent state block [hb, Dk, Dv] in state_bytes) and the pipelined blocks (x [1, cb],
    a and b [1, hb], o [hb, Dv], each padded to a sublane tile); plus one row's f32
    temporaries (~6 [Dk, Dv] per value head) and the conv weights.
    """
    state = _tile(4, geom.cb, x_bytes) + geom.hb * _tile(geom.Dk, geom.Dv, state_bytes)
    blocks = (_tile(1, geom.cb, x_bytes) + 2 * _tile(1, geom.hb, x_bytes)
              + _tile(geom.hb, geom.Dv, x_bytes))
    temps = 6 * geom.hb * _tile(geom.Dk, geom.Dv, 4) + 2 * _tile(geom.K, geom.cb, x_bytes)
    return 2 * rb * (state + blocks) + temps


def rows_error(rb):
    """Why ``rb`` decode rows per grid step is illegal (None if it is not)."""
    if not isinstance(rb, int) or isinstance(rb, bool) or rb < 1:
        return f"rows_per_step must be a positive int, got {rb!r}"
    return None


def default_rows_per_step(geom, num_rows, state_bytes, x_bytes):
    """``DEFAULT_ROWS_PER_STEP`` halved until the VMEM estimate fits in 12 MiB (under v5e's
    16 MiB default scoped limit), and at most ``num_rows`` (no grid step of padding only)."""
    rb = DEFAULT_ROWS_PER_STEP
    while rb > 1 and decode_vmem_bytes(geom, rb, state_bytes, x_bytes) > _DECODE_VMEM_BUDGET:
        rb //= 2
    return max(1, min(rb, num_rows))


def decode_fits(geom, rb, state_bytes, x_bytes):
    """Whether rb rows per step fit the decode kernel's largest scoped VMEM limit (60 MiB,
    with 25% headroom on the estimate)."""
    return 1.25 * decode_vmem_bytes(geom, rb, state_bytes, x_bytes) <= _VMEM_MAX


def decode_vmem_limit(geom, state_bytes, x_bytes):
    """Scoped VMEM limit of the decode kernel at ``geom.rb`` rows per step: None (the
    compiler's default) when the estimate with 25% headroom fits in 16 MiB, else that,
    capped at 60 MiB."""
    need = 1.25 * decode_vmem_bytes(geom, geom.rb, state_bytes, x_bytes)
    return None if need <= _VMEM_MIN else int(min(need, _VMEM_MAX))
