"""The package: its layers (nothing imports upward and no modules import each other in a
circle, lazy imports included; read from the source with `ast`) and what a wheel ships (the
packaging configuration against the files, without building one)."""

import ast
import importlib.resources
import tomllib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jaxinfer"

# Floors, lowest first; names on one floor are independent siblings (neither imports the other).
# `ops` below `kernels`: kernels implement ops for a backend (the CPU's FFI calls today), and
# the model reaches them only through its one seam (model/linear.py, kvcache.update).
# `jaxinfer` is the package's __init__ (the public facade), above everything it re-exports.
LAYERS = [
    {"errors"},
    {"config", "shardings"},
    {"options"},
    {"ops"},
    {"formats", "kernels"},
    {"model"},
    {"parallel"},
    {"runtime"},
    {"engine"},
    {"loader"},
    {"jaxinfer"},
    {"serve"},
    {"cli"},
]
FLOOR = {name: i for i, names in enumerate(LAYERS) for name in names}


def modules() -> dict[str, Path]:
    """Dotted module name -> file, e.g. jaxinfer.model.kvcache, jaxinfer.kernels (its
    __init__)."""
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = ("jaxinfer", *f.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def imports(name: str, file: Path, known: dict[str, Path]) -> set[str]:
    """The jaxinfer modules `name` imports anywhere in its file."""
    is_package = file.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "jaxinfer"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            elif (node.module or "").split(".")[0] == "jaxinfer":
                base = node.module
            else:
                continue
            for alias in node.names:  # `from pkg import module` names a module when one exists
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return {m for m in found if m != name}


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "jaxinfer"


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, file, known) for name, file in known.items()}


def test_every_module_has_a_layer():
    unplaced = sorted({layer(m) for m in modules()} - set(FLOOR))
    assert not unplaced, f"add these to LAYERS: {unplaced}"


def test_nothing_imports_upward_or_sideways():
    wrong = []
    for module, targets in graph().items():
        for target in targets:
            a, b = layer(module), layer(target)
            if a != b and FLOOR[b] >= FLOOR[a]:
                wrong.append(f"{module} -> {target} ({a} on floor {FLOOR[a]}, {b} on {FLOOR[b]})")
    assert not wrong, "\n".join(sorted(wrong))


# Inside runtime/: the host-side modules (what runs between calls: scheduling, the KV pool,
# requests, shapes, counters) never import the device programs; the executor is the one seam.
HOST_SIDE = {"scheduler", "kv", "pages", "request", "buckets", "perf", "drafting"}
DEVICE_PROGRAMS = {"steps", "speculative", "programs"}


def test_host_side_runtime_never_imports_the_device_programs():
    wrong = [
        f"{module} -> {target}"
        for module, targets in graph().items()
        for target in targets
        if module.startswith("jaxinfer.runtime.")
        and module.rsplit(".", 1)[1] in HOST_SIDE
        and target.startswith("jaxinfer.runtime.")
        and target.rsplit(".", 1)[1] in DEVICE_PROGRAMS
    ]
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_circles():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not circles, "\n".join(circles)


def test_the_check_sees_lazy_and_relative_imports():
    """The walker itself: a lazy relative import inside a function is an edge."""
    edges = graph()
    assert "jaxinfer.serve.server" in edges["jaxinfer.cli"]  # imported inside _serve()
    assert "jaxinfer.ops.quant" in edges["jaxinfer.model.linear"]
    assert "jaxinfer.kernels" in edges["jaxinfer.model.linear"]


def test_every_subpackage_and_data_file_is_packaged():
    """pyproject's package list names every folder of jaxinfer/ and its package-data globs
    take the built-in model, its license, the layouts and the kernel sources."""
    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {
        "jaxinfer." + ".".join(d.relative_to(PACKAGE).parts)
        for d in PACKAGE.rglob("*")
        if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py")) or d.name == "data"
    }
    assert folders | {"jaxinfer", "jaxinfer.shardings"} == set(project["packages"])
    data = project["package-data"]
    shipped = {
        pkg: {f.name for pattern in globs for f in (_root(pkg)).glob(pattern)}
        for pkg, globs in data.items()
    }
    assert {"stories260K.gguf", "LICENSE"} <= shipped["jaxinfer.data"]
    layouts = {f"{name}.toml" for name in ("single", "layer", "tensor", "layer-tensor", "expert",
                                           "layer-expert")}  # fmt: skip
    assert layouts <= shipped["jaxinfer.shardings"]
    sources = {f.name for f in (PACKAGE / "kernels" / "cpu" / "src").iterdir()}
    assert sources <= shipped["jaxinfer.kernels.cpu"]


def _root(package: str) -> Path:
    """A package's folder as setuptools sees it (package-dir maps jaxinfer.shardings)."""
    if package == "jaxinfer.shardings":
        return PACKAGE.parent / "shardings"
    return PACKAGE.joinpath(*package.split(".")[1:])


def test_the_installed_package_finds_its_layouts_and_model():
    layouts = importlib.resources.files("jaxinfer.shardings")
    assert layouts.joinpath("layer-tensor.toml").is_file()
    data = importlib.resources.files("jaxinfer") / "data"
    assert data.joinpath("stories260K.gguf").is_file() and data.joinpath("LICENSE").is_file()
