"""benchmarks/sweep_block_sizes.py --compile-only: the GDN candidates compiled by libtpu for a
v5e at the 397B shapes (about 40 s on a 2-core CPU), printed, not written (--dry-run).

The untimed entry keeps the shape default (no overrides); every candidate compiles, and the
chunk kernel's VMEM grows with the head block, within a v5e TensorCore's 128 MiB: 5.27 /
10.17 / 19.89 MiB (the largest over the 3 cases) at k_heads_per_block 2 / 4 / 8 with bf16
matmul operands (2026-12-07; 10.49 at 4 heads after the split-once inverse), and the default's is
the chunk kernel's at its default block of 4 qk heads. The decode kernel's rows_per_step candidates (1 / 2 / 4 / 16 beside the
default 8) compile too.
"""

from __future__ import annotations

import json
import os

from tests.scripts import load_script

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def test_gdn_compile_sweep_for_v5e(tmp_path, monkeypatch):
    sweep = load_script("benchmarks/sweep_block_sizes.py")
    # The default, the head blocks and one decode row block (each candidate compiles all
    # three GDN cases; the other row blocks only add decode compiles, ~45 s of CI).
    monkeypatch.setitem(sweep.CANDIDATES, "gdn", sweep.CANDIDATES["gdn"][:5])
    table = tmp_path / "table.json"
    table.write_text('{"device_kinds": {}}')
    out = sweep.main(["--compile-only", "v5e:2x2", "--only", "gdn", "--dry-run",
                      "--table", str(table)])
    assert table.read_text() == '{"device_kinds": {}}'  # --dry-run wrote nothing
    assert out["device_kind"] == "TPU v5 lite" and set(out["entries"]) == {"gdn"}
    e = out["entries"]["gdn"]
    assert e["timed"] is False and e["overrides"] == {}
    assert e["source"].startswith("compile sweep v5e:2x2, 397b preset")
    cands = e["candidates"]
    assert [c["blocks"] for c in cands] == sweep.CANDIDATES["gdn"]
    assert all(c["compiled"] and c["cases"] == 3 for c in cands), cands
    vmem = [c["max_vmem_mib"] for c in cands]  # default, 2, 4, 8 heads, then rows_per_step 1
    assert 0 < vmem[1] < vmem[2] < vmem[3] < 128, vmem
    assert vmem[0] == vmem[2], vmem  # the default chunk block is 4 qk heads


def _custom_call(used: list[tuple[int, int]], region: list[tuple[int, int]]) -> str:
    cfg = {"used_scoped_memory_configs": [{"memory_space": "1", "offset": str(o), "size": str(s)}
                                          for o, s in used],
           "scoped_memory_configs": [{"memory_space": "1", "offset": str(o), "size": str(s)}
                                     for o, s in region]}
    return ('  %gdn.1 = bf16[8] custom-call(), custom_call_target="tpu_custom_call", '
            f'metadata={{op_name="gdn"}}, backend_config={json.dumps(cfg)}')


def test_kernel_vmem_excludes_what_xla_keeps_below_its_region():
    """A kernel's VMEM is its own: when XLA:TPU keeps a 96 MiB operand in a v5e's VMEM, the
    kernel's region starts at 96 MiB and the used range is reported from 0 (a GDN chunk
    compile at 4 qk heads read 106 MiB for ~10 MiB of its own); from 0, nothing changes."""
    from sglang_tpu_backend.kernels.tpu_compile import mosaic_kernels

    mib = 1 << 20
    hlo = "\n".join(["HloModule m", _custom_call([(0, 106 * mib)], [(96 * mib, 19 * mib)]),
                     _custom_call([(0, 10 * mib)], [(0, 19 * mib)])])
    kernels = mosaic_kernels(hlo)
    assert [(k.vmem_used_bytes, k.vmem_limit_bytes) for k in kernels] == [
        (10 * mib, 19 * mib), (10 * mib, 19 * mib)]
