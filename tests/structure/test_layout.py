"""The code's shape: imports run downward only, files and functions stay readable.

Layers, lowest first; a module may import its own layer and the ones below. Most modules
take their package's layer; the few leaf modules that lower layers share (errors, step
inputs, the mesh, per-request state) are named on their own. Function-level imports count, except the package root's one lazy export of the offline
Engine (``sglang_tpu_backend.Engine``).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("sglang_tpu_backend", "kernels", "ray_app")
LAYERS = [
    # 0: leaves: the package root (its __version__), kernels, configuration, errors, the
    #    step's input pytree
    ("sglang_tpu_backend", "kernels", "sglang_tpu_backend.config", "sglang_tpu_backend.checkpoint_io",
     "sglang_tpu_backend.managers.io_struct", "sglang_tpu_backend.model_executor.forward_mode",
     "sglang_tpu_backend.model_executor.forward_batch", "sglang_tpu_backend.parallel.mesh",
     "sglang_tpu_backend.metrics.router_stats", "sglang_tpu_backend.hlo_text"),
    # 1: the model, tokenizer, caches, sampling, drafting, grammars, metrics, per-request state
    ("sglang_tpu_backend.server_args", "sglang_tpu_backend.models", "sglang_tpu_backend.tokenizer",
     "sglang_tpu_backend.tiny_model", "sglang_tpu_backend.loader",
     "sglang_tpu_backend.checkpoint_shapes", "sglang_tpu_backend.mem_cache",
     "sglang_tpu_backend.sampling", "sglang_tpu_backend.constrained", "sglang_tpu_backend.metrics",
     "sglang_tpu_backend.profiler", "sglang_tpu_backend.roofline",
     "sglang_tpu_backend.compiled_roofline", "sglang_tpu_backend.compiled_timeline",
     "sglang_tpu_backend.program_roofline",
     "sglang_tpu_backend.managers.schedule_batch", "sglang_tpu_backend.managers.handover",
     "sglang_tpu_backend.speculative"),
    # 2: running the model: one device, DP, TP, multi-host; loading into shardings; planning
    ("sglang_tpu_backend.model_executor", "sglang_tpu_backend.parallel", "sglang_tpu_backend.plan",
     "sglang_tpu_backend.mem_budget", "sglang_tpu_backend.generate",
     "sglang_tpu_backend.sharded_loader", "sglang_tpu_backend.host_load"),
    # 3: the engine's components (scheduler, loop, outputs, handover, weight updates)
    ("sglang_tpu_backend.managers",),
    # 4: the engine facade
    ("sglang_tpu_backend.engine",),
    # 5: HTTP and offline APIs, the server entry point
    ("sglang_tpu_backend.entrypoints", "sglang_tpu_backend.launch_server"),
    # 6: the Ray Serve app
    ("ray_app",),
]
MAX_FILE_LINES = 600  # sglang_tpu_backend/
MAX_FUNCTION_LINES = 80  # outside kernels/


def _layer(module: str) -> int:
    """The layer of the longest prefix of ``module`` named in LAYERS."""
    best, layer = -1, None
    for k, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, layer = len(name), k
    assert layer is not None, f"{module} is in no layer: add it to LAYERS"
    return layer


def _modules():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "assets" in path.parts:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join(parts), path


def _imports(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_layer_rule_itself():
    assert _layer("sglang_tpu_backend.managers.scheduler") == 3
    assert _layer("sglang_tpu_backend.managers.io_struct") == 0
    assert _layer("sglang_tpu_backend.model_executor.model_runner") == 2
    assert _layer("sglang_tpu_backend") == 0 and _layer("kernels.gdn") == 0
    assert _layer("sglang_tpu_backend.entrypoints.http_server") == 5


def test_imports_point_downward():
    upward = []
    for module, path in _modules():
        if module == "sglang_tpu_backend":
            continue  # __getattr__'s lazy public export
        own = _layer(module)
        for name in _imports(ast.parse(path.read_text())):
            if name.split(".")[0] not in PACKAGES:
                continue
            if _layer(name) > own:
                upward.append(f"{module} (layer {own}) imports {name} (layer {_layer(name)})")
    assert not upward, "\n".join(upward)


def test_files_and_functions_stay_readable():
    too_long = []
    for module, path in _modules():
        src = path.read_text()
        if module.startswith("sglang_tpu_backend") and src.count("\n") > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {src.count(chr(10))} lines")
        if module.startswith("kernels"):
            continue
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not too_long, "\n".join(too_long)
