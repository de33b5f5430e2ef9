"""Planning and measurement before (or beside) serving: what a shape costs and whether it fits.

``plan`` is the per-device memory planner (``python -m sglang_tpu_backend.plan``) and
``mem_budget`` sizes the KV pool from ``--mem-fraction-static`` with plan's byte formulas;
``roofline`` gives the analytic throughput ceilings per chip; ``hlo_text`` parses a compiled
program's HLO text, ``compiled_roofline`` charges every op of it at the hardware's peaks,
``compiled_timeline`` adds the overlap-aware step time and ``program_roofline`` compares the
charged program against the roofline (program efficiency). Nothing is re-exported here:
import the module you need (``from sglang_tpu_backend.planning.plan import ...``).
"""
