"""benchmarks/sweep_block_sizes.py --compile-only: the GDN candidates compiled by libtpu for a
v5e at the 397B shapes (about 40 s on a 2-core CPU), printed, not written (--dry-run).

The untimed entry keeps the shape default (no overrides); every candidate compiles within a
v5e TensorCore's 128 MiB of VMEM, and the chunk kernel's VMEM grows from the default head block
to 2 qk heads; the decode kernel's rows_per_step candidates (1 / 2 / 4 / 16 beside the default
8) compile too. With f32 matmul operands the chunk kernel took 3.3 / 6.5 / 13.5 / 29.1 MiB at
k_heads_per_block 1 / 2 / 4 / 8; with the bf16 operands it takes for bf16 activations
(twelfth session) 2.9 / 5.3 / 106.2 / 19.9 MiB: the jump at 4 heads (16 value heads) is
Mosaic's, cause not yet found, and on a 64 MiB TensorCore that candidate would not fit.
"""

from __future__ import annotations

import os

from tests.scripts import load_script

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def test_gdn_compile_sweep_for_v5e(tmp_path):
    sweep = load_script("benchmarks/sweep_block_sizes.py")
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
    vmem = [c["max_vmem_mib"] for c in cands]  # default (1 head), 2, 4, 8, then rows_per_step
    assert 0 < vmem[0] < vmem[1] and max(vmem) < 128, vmem
