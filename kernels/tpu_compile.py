"""Compile JAX programs for an Ironwood (TPU7x) topology that is not attached.

libtpu ships a compile-only client: on any machine with ``libtpu`` installed, Mosaic compiles
Pallas TPU kernels and XLA:TPU compiles whole (sharded) programs for a named topology from
abstract arrays, no TPU and no weights needed. That proves what interpret mode cannot: that
Mosaic accepts a kernel's layouts, that its VMEM fits, and that the program fits in HBM.
Numerics still come from interpret mode, and speed stays unmeasured (``cost_analysis`` is
XLA's estimate).

Typical use::

    mesh = core_mesh()                                   # one TPU7x TensorCore
    args = [abstract((T, H), jnp.bfloat16, mesh), ...]
    report = compile_for_tpu(lambda x, ...: op(x, ..., impl="pallas"), args, mesh)
    report.kernels        # one MosaicKernel per Pallas custom call: VMEM used and limit
    report.memory         # compiled.memory_analysis() fields, bytes per device

Works with ``JAX_PLATFORMS=cpu``: the default backend stays the CPU, and Pallas lowering is
told the TPU generation through the abstract mesh.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# One TPU7x TensorCore (one JAX device) has 64 MiB of VMEM.
TPU7X_VMEM_BYTES = 64 * 1024 * 1024
DEFAULT_TOPOLOGY = "tpu7x:2x2x1"  # one Ironwood host: 4 chips x 2 TensorCores

# XLA flags for a compile whose cost_analysis() should count HBM traffic only. By default
# XLA:TPU prefetches operands that fit into VMEM with async copies, and its cost analysis
# charges each such copy's start and done as bytes accessed on top of the consumer's own
# charge (a 16 MiB operand of a Pallas call: 67 MB counted, 0 without the prefetch). With
# VMEM memory-space assignment off, a Pallas call costs exactly its CostEstimate and every
# other op its operands and results.
NO_VMEM_PREFETCH = {"xla_gf_vmem_memory_space_assignment": False}

_MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                  "temp_size_in_bytes", "generated_code_size_in_bytes")


def libtpu_available() -> bool:
    """True when the libtpu compiler is installed (``jax[tpu]``)."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True


def topology_devices(topology: str = DEFAULT_TOPOLOGY) -> list:
    """The (absent) TPU devices of ``topology``, e.g. 8 for ``tpu7x:2x2x1``."""
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "tpu7x-8")  # quiets libtpu's host probing
    # Compile-only use touches no device: several processes (pytest workers, other tools) may
    # hold libtpu at once without contending for its multi-process lockfile.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    desc = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    return list(desc.devices)


def core_mesh(topology: str = DEFAULT_TOPOLOGY) -> Mesh:
    """A one-device mesh on the first TensorCore of ``topology`` (axis name ``"core"``)."""
    return Mesh(np.array(topology_devices(topology)[:1]), ("core",))


def host_mesh(axis_names: Sequence[str], shape: Sequence[int],
              topology: str = DEFAULT_TOPOLOGY) -> Mesh:
    """A mesh over all devices of ``topology`` reshaped to ``shape`` (e.g. (4, 2) chip x die)."""
    devices = topology_devices(topology)
    return Mesh(np.array(devices).reshape(tuple(shape)), tuple(axis_names))


def abstract(shape, dtype, mesh: Mesh, spec: PartitionSpec = PartitionSpec()):
    """An abstract array (no data) placed on ``mesh`` with ``spec``."""
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=NamedSharding(mesh, spec))


@dataclasses.dataclass(frozen=True)
class MosaicKernel:
    """One Pallas (Mosaic) kernel in a compiled program.

    name: the op name XLA records for the custom call.
    vmem_used_bytes: scoped VMEM the compiled kernel uses (its own, not what XLA placed in VMEM
      below its region: ``_scoped_vmem``).
    vmem_limit_bytes: the scoped VMEM limit it was compiled under.
    has_communication: the kernel talks to other devices (remote DMA, e.g. a reduce-scatter).
    instruction: the custom call's HLO instruction name (what libtpu's dumps are named by).
    """

    name: str
    vmem_used_bytes: int
    vmem_limit_bytes: int
    has_communication: bool = False
    instruction: str = ""


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """What compiling one program for the TPU target produced.

    seconds: wall time of lowering + compilation.
    memory: ``memory_analysis()`` fields in bytes per device.
    cost: ``cost_analysis()`` totals (``flops``, ``bytes accessed``, ``optimal_seconds``, ...).
    kernels: the Mosaic custom calls of the program, in HLO order.
    hlo: the compiled HLO text.
    """

    seconds: float
    memory: dict[str, int]
    cost: dict[str, float]
    kernels: tuple[MosaicKernel, ...]
    hlo: str

    @property
    def max_vmem_used_bytes(self) -> int:
        return max((k.vmem_used_bytes for k in self.kernels), default=0)

    def summary(self) -> str:
        mib = 1024 * 1024
        mem = ", ".join(f"{k.replace('_size_in_bytes', '')} {v / mib:.1f} MiB"
                        for k, v in self.memory.items() if k != "generated_code_size_in_bytes")
        vm = ", ".join(f"{k.vmem_used_bytes / mib:.2f}/{k.vmem_limit_bytes / mib:.0f} MiB"
                       for k in self.kernels)
        return f"{self.seconds:.1f} s; {mem}; {len(self.kernels)} Mosaic kernels (VMEM {vm})"


def _scoped_vmem(cfg: dict) -> tuple[int, int]:
    """(used, limit) bytes of a Mosaic kernel's scoped VMEM (memory space 1) from its backend
    config. The kernel's region starts at the offset of ``scoped_memory_configs``, which is
    past any VMEM that XLA:TPU gave the program's other buffers (on a v5e's 128 MiB it may
    keep a whole 96 MiB operand there); ``used_scoped_memory_configs`` gives the used range
    from offset 0, so the kernel's own use is that range's end less the region's start."""
    def vmem(key):
        return [(int(c.get("offset", 0)), int(c["size"])) for c in cfg.get(key, [])
                if c.get("memory_space") == "1"]

    region, used = vmem("scoped_memory_configs"), vmem("used_scoped_memory_configs")
    start = min((off for off, _ in region), default=0)
    end = max((off + size for off, size in used), default=start)
    return max(0, end - start), sum(size for _, size in region)


def mosaic_kernels(hlo: str) -> tuple[MosaicKernel, ...]:
    """Parse the ``tpu_custom_call`` instructions of compiled HLO text.

    An instruction may span lines (kernel metadata can hold newlines), so the text is cut at
    instruction starts rather than at line ends; the backend config is decoded as JSON.
    """
    out = []
    decoder = json.JSONDecoder()
    for instr in re.split(r"\n\s*(?=(?:ROOT )?%[\w.\-]+ = )", hlo):
        if 'custom_call_target="tpu_custom_call"' not in instr:
            continue
        name = re.search(r'op_name="([^"]*)"', instr)
        used = limit = 0
        comm = False
        at = instr.find("backend_config=")
        if at >= 0:
            cfg, _ = decoder.raw_decode(instr[at + len("backend_config="):])
            comm = bool(cfg.get("custom_call_config", {}).get("has_communication", False))
            used, limit = _scoped_vmem(cfg)
        instruction = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", instr)
        out.append(MosaicKernel(name.group(1) if name else "?", used, limit, comm,
                                instruction.group(1) if instruction else ""))
    return tuple(out)


def compile_for_tpu(fn: Callable, args: Sequence[Any], mesh: Mesh, *,
                    donate_argnums: Sequence[int] = (), static_kwargs: dict | None = None,
                    compiler_options: dict | None = None) -> CompileReport:
    """Lower and compile ``fn(*args, **static_kwargs)`` for the TPU devices of ``mesh``.

    ``args`` are abstract arrays (see :func:`abstract`) or pytrees of them. Raises whatever
    Mosaic or XLA:TPU raise when the program does not compile. ``compiler_options`` are XLA
    flags for this compile only (e.g. :data:`NO_VMEM_PREFETCH`).
    """
    static_kwargs = static_kwargs or {}
    start = time.perf_counter()
    jitted = jax.jit(lambda *a: fn(*a, **static_kwargs), donate_argnums=tuple(donate_argnums))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        lowered = jitted.lower(*args)
    compiled = lowered.compile(compiler_options=compiler_options)
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    memory = {f: int(getattr(stats, f)) for f in _MEMORY_FIELDS if hasattr(stats, f)}
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, (list, tuple)):  # older jax: one dict per device
        cost = cost[0] if cost else {}
    totals = {k: float(v) for k, v in cost.items()
              if k in ("flops", "bytes accessed", "transcendentals", "optimal_seconds")}
    hlo = compiled.as_text()
    return CompileReport(seconds, memory, totals, mosaic_kernels(hlo), hlo)
