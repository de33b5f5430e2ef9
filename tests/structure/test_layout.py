"""The code's shape: imports run downward only, files and functions stay readable.

Layers, lowest first; a module may import its own layer and the ones below. Most modules
take their package's layer; the few leaf modules that lower layers share (errors, step
inputs, the mesh, per-request state) are named on their own, and so is every module of
model_loader/ and planning/, whose modules span layers 0-2. Function-level imports count,
except the package root's one lazy export of the offline Engine (``sglang_tpu_backend.Engine``).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("sglang_tpu_backend", "ray_app")
# Each source folder and its import name: kernels/ imports as sglang_tpu_backend.kernels
# (pyproject's package-dir; the modules in it import each other relatively).
FOLDERS = {"sglang_tpu_backend": "sglang_tpu_backend", "kernels": "sglang_tpu_backend.kernels",
           "ray_app": "ray_app"}
KERNELS = "sglang_tpu_backend.kernels"
# Packages whose modules sit on different layers: each of their modules is named in LAYERS.
MODEL_LOADER = "sglang_tpu_backend.model_loader"
PLANNING = "sglang_tpu_backend.planning"
SPLIT_PACKAGES = (MODEL_LOADER, PLANNING)
LAYERS = [
    # 0: leaves: the package root (its __version__), kernels, configuration, errors, the
    #    step's input pytree, checkpoint file I/O, the HLO text parser
    ("sglang_tpu_backend", KERNELS, "sglang_tpu_backend.config",
     "sglang_tpu_backend.managers.io_struct", "sglang_tpu_backend.model_executor.forward_mode",
     "sglang_tpu_backend.model_executor.forward_batch", "sglang_tpu_backend.parallel.mesh",
     "sglang_tpu_backend.metrics.router_stats",
     f"{MODEL_LOADER}.checkpoint_io", f"{PLANNING}.hlo_text"),
    # 1: the model, tokenizer, caches, sampling, drafting, grammars, metrics, per-request state;
    #    checkpoint reading and checking, the tiny model; the rooflines
    ("sglang_tpu_backend.server_args", "sglang_tpu_backend.models", "sglang_tpu_backend.tokenizer",
     "sglang_tpu_backend.mem_cache", "sglang_tpu_backend.sampling",
     "sglang_tpu_backend.constrained", "sglang_tpu_backend.metrics",
     "sglang_tpu_backend.managers.schedule_batch", "sglang_tpu_backend.managers.handover",
     "sglang_tpu_backend.speculative",
     f"{MODEL_LOADER}.tiny_model", f"{MODEL_LOADER}.loader", f"{MODEL_LOADER}.checkpoint_shapes",
     f"{PLANNING}.roofline", f"{PLANNING}.compiled_roofline", f"{PLANNING}.compiled_timeline",
     f"{PLANNING}.program_roofline"),
    # 2: running the model: one device, DP, TP, multi-host; loading into shardings; planning
    ("sglang_tpu_backend.model_executor", "sglang_tpu_backend.parallel",
     "sglang_tpu_backend.generate", f"{MODEL_LOADER}.sharded_loader", f"{MODEL_LOADER}.host_load",
     f"{MODEL_LOADER}.read_ahead", f"{MODEL_LOADER}.host_pool",
     f"{MODEL_LOADER}.load_programs",
     f"{PLANNING}.plan", f"{PLANNING}.mem_budget"),
    # 3: the engine's components (scheduler, loop, outputs, handover, weight updates, traces)
    ("sglang_tpu_backend.managers",),
    # 4: the engine facade
    ("sglang_tpu_backend.engine",),
    # 5: HTTP and offline APIs, the command-line entry points (the server, the planner's
    #    ``python -m sglang_tpu_backend.plan``)
    ("sglang_tpu_backend.entrypoints", "sglang_tpu_backend.launch_server",
     "sglang_tpu_backend.plan"),
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
    for folder, name in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "assets" in path.parts:
                continue
            parts = [name, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join(parts), path


def _imports(tree: ast.AST, module: str = "", path: pathlib.Path | None = None):
    """Absolute names of what ``module`` (at ``path``) imports; relative imports resolved."""
    package = module if path is not None and path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)  # (a submodule or a name)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            if node.module:
                yield f"{base}.{node.module}"
            else:  # from . import a, b: submodules (or names) of base
                yield from (f"{base}.{a.name}" for a in node.names)


def test_layer_rule_itself():
    assert _layer("sglang_tpu_backend.managers.scheduler") == 3
    assert _layer("sglang_tpu_backend.managers.io_struct") == 0
    assert _layer("sglang_tpu_backend.model_executor.model_runner") == 2
    assert _layer("sglang_tpu_backend") == 0 and _layer(f"{KERNELS}.gdn") == 0
    assert _layer("sglang_tpu_backend.entrypoints.http_server") == 5
    assert _layer(f"{MODEL_LOADER}.checkpoint_io") == 0 and _layer(f"{PLANNING}.hlo_text") == 0
    assert _layer(f"{MODEL_LOADER}.loader") == 1 and _layer(f"{PLANNING}.roofline") == 1
    assert _layer(f"{MODEL_LOADER}.sharded_loader") == 2 and _layer(f"{PLANNING}.plan") == 2
    assert _layer("sglang_tpu_backend.plan") == 5  # the entry point, not a prefix of planning
    assert _layer("sglang_tpu_backend.managers.profiler") == 3


def test_split_packages_name_each_module_and_export_nothing():
    """model_loader/ and planning/ span layers, so each module is named in LAYERS (a new one
    does not silently take the package root's layer 0); their ``__init__`` imports nothing
    (explicit imports: ``from sglang_tpu_backend.model_loader.loader import ...``)."""
    named = {name for names in LAYERS for name in names}
    unnamed, exporting = [], []
    for module, path in _modules():
        if not module.startswith(SPLIT_PACKAGES):
            continue
        if path.name == "__init__.py":
            tree = ast.parse(path.read_text())
            if any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(tree)):
                exporting.append(module)
        elif module not in named:
            unnamed.append(module)
    assert not unnamed, f"name these in LAYERS: {unnamed}"
    assert not exporting, f"these package roots import (re-export) something: {exporting}"


def test_relative_imports_resolve():
    tree = ast.parse("from . import dispatch\nfrom ..cost import Cost\nfrom .common import X")
    rpa = ROOT / "kernels" / "ragged_paged_attention"
    assert list(_imports(tree, f"{KERNELS}.ragged_paged_attention", rpa / "__init__.py")) == [
        f"{KERNELS}.ragged_paged_attention.dispatch", f"{KERNELS}.cost",
        f"{KERNELS}.ragged_paged_attention.common"]
    assert list(_imports(tree, f"{KERNELS}.ragged_paged_attention.xla", rpa / "xla.py")) == [
        f"{KERNELS}.ragged_paged_attention.dispatch", f"{KERNELS}.cost",
        f"{KERNELS}.ragged_paged_attention.common"]


def test_imports_point_downward():
    upward = []
    for module, path in _modules():
        if module == "sglang_tpu_backend":
            continue  # __getattr__'s lazy public export
        own = _layer(module)
        for name in _imports(ast.parse(path.read_text()), module, path):
            if name.split(".")[0] not in PACKAGES:
                continue
            if _layer(name) > own:
                upward.append(f"{module} (layer {own}) imports {name} (layer {_layer(name)})")
    assert not upward, "\n".join(upward)


def _import_graph() -> dict[str, set[str]]:
    """Each project module -> the project modules it imports (any level of the file, function
    bodies included; ``from pkg import sub`` counts as ``pkg.sub``), itself and the package
    root's lazy export left out."""
    modules = dict(_modules())

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for module, path in modules.items():
        deps = {resolve(n) for n in _imports(ast.parse(path.read_text()), module, path)
                if n.split(".")[0] in PACKAGES}
        graph[module] = deps - {module, "sglang_tpu_backend", ""}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    """No two modules import each other, directly or through others: what both need moves
    down a layer, what composes them lives above them (a registry above its drafters)."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    circles = _circles(_import_graph())
    assert not circles, "\n".join(" <-> ".join(c) for c in circles)


def test_files_and_functions_stay_readable():
    too_long = []
    for module, path in _modules():
        src = path.read_text()
        kernel = module == KERNELS or module.startswith(KERNELS + ".")
        if module.startswith("sglang_tpu_backend") and not kernel and src.count("\n") > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {src.count(chr(10))} lines")
        if kernel:
            continue
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not too_long, "\n".join(too_long)


def test_setup_env_reads_its_flags_in_any_order():
    """scripts/setup_env.sh takes --test / --no-py312 / --py312 in any position (it read
    --no-py312 only as the second argument) and names an unknown flag."""
    import subprocess

    script = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "setup_env.sh"
    out = subprocess.run(["bash", str(script), "--no-py312", "--bogus"], capture_output=True,
                         text=True)
    assert out.returncode == 2 and "unknown flag --bogus" in out.stderr
    text = script.read_text()
    assert '"${2:-}"' not in text and '"${1:-}"' not in text


def test_readme_architecture_names_every_package():
    """README's Architecture section has a line for each package of sglang_tpu_backend/ and
    each top-level source folder, and names no package that is gone."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Architecture\n", 1)[1].split("\n## ", 1)[0]
    packages = {p.parent.name for p in (ROOT / "sglang_tpu_backend").glob("*/__init__.py")}
    folders = {"kernels", "ray_app", "deploy", "monitoring", "benchmarks", "tests"}
    named = set()
    for line in section.splitlines():
        if line.startswith("- `") and "/`" in line.split(":")[0]:
            named.add(line[3:].split("/`", 1)[0])
    missing = sorted((packages | folders) - named)
    assert not missing, f"README's Architecture section lacks a line for {missing}"
    gone = sorted(named - packages - folders - {"sglang_tpu_backend", "examples"})
    assert not gone, f"README's Architecture section names folders that do not exist: {gone}"
