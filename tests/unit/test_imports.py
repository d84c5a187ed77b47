"""The import structure of ``ir``, ``backends`` and ``epgen``: every module imports, the
graph of module-level imports between our modules has no cycle, and neither has the graph
that adds the imports made inside functions (a function-local import must never be what
hides a cycle). Function-local imports of our own packages are allowed only in the modules
of ``LOCAL_IMPORTS``, each for a reason, and only of the packages named there.

The graph is read from the source with ``ast``: ``import a.b`` and ``from a.b import c``
(``c`` a module or a name), relative imports resolved; importing ``a.b.c`` also imports the
packages ``a`` and ``a.b`` (unless the importer is inside them). Imports under
``if TYPE_CHECKING:`` are not run and are left out.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("ir", "backends", "epgen")

# module -> (packages it may import inside functions, why)
LOCAL_IMPORTS: dict[str, tuple[tuple[str, ...], str]] = {
    "epgen": (("epgen.kernels", "backends.nvptx", "epgen.runtime", "epgen.formats"),
              "`import epgen` stays light: build_module, emit_ptx, EmulatedWorld and P2PWorld "
              "load the kernels, llvmlite and cuda.core when first used, the format classes "
              "(read from the registry) when first named"),
    "epgen.cli": (("epgen.config", "epgen.goldens", "backends.cuda"),
                  "the CLI's lazy start: `epgen --help` and a usage error import no backend, "
                  "each command imports what it runs; main() names the errors it reports"),
    "epgen.commands.common": (("epgen",), "as epgen.cli: the presets, the configuration, "
                                          "the tuning and the goldens when a command reads them"),
    "epgen.commands.ptx": (("epgen", "backends.nvptx", "ir"), "as epgen.cli"),
    "epgen.commands.inspect": (("epgen",), "as epgen.cli"),
    "epgen.commands.variants": (("epgen",), "as epgen.cli"),
    "epgen.commands.diff": (("backends.nvptx",), "as epgen.cli"),
    "epgen.commands.run": (("epgen",), "as epgen.cli"),
    "epgen.commands.run_options": (("epgen.runtime",), "as epgen.cli"),
    "epgen.commands.run_shmem": (("epgen",), "as epgen.cli"),
    "epgen.commands.bench": (("epgen.bench",), "as epgen.cli"),
    "epgen.commands.check_ordering": (("epgen.ordering",), "as epgen.cli"),
    "epgen.commands.launch": (("epgen.launch",), "as epgen.cli"),
    "epgen.ep_goldens": (("epgen", "ir"),
                         "each golden builds its module when asked (`epgen variants` lists the "
                         "names without building the kernels)"),
    "epgen.goldens": (("backends.nvptx", "ir.printer"),
                      "the registry imports without llvmlite; PTX is emitted when asked"),
    "epgen.inspection": (("backends.nvptx", "epgen.kernels"),
                         "llvmlite and the kernels only for the sections that need them"),
    "epgen.variants": (("epgen.ep_goldens", "epgen.presets"),
                       "the matrix reads the presets only when a combination is built"),
    "epgen.interop": (("backends.cuda",),
                      "host inputs never load the CUDA backend: the driver is asked only "
                      "about device inputs"),
    "epgen.bench.memory": (("backends.cuda",),
                           "epgen.bench imports with numpy only (tests/unit/test_bench.py::"
                           "test_import_is_light): backends.cuda inside device functions"),
    "epgen.bench.driver": (("backends.cuda",), "as epgen.bench.memory"),
    "epgen.bench.deepep_api": (("epgen.deepep",),
                               "epgen.deepep imports torch, which `epgen bench` needs only "
                               "with --api deepep"),
    "epgen.deepep.emulated": (("backends.cuda",), "the GPU's SM count only when a CUDA "
                                                  "group sizes its grid"),
    "epgen.bench.options": (("epgen.bench.plan", "epgen.runtime.shmem_world"),
                            "`epgen --help` builds these options without plan's imports (the "
                            "configuration, the formats, ml_dtypes), and without the SHMEM "
                            "world's (backends.cuda) unless --world shmem is parsed"),
    "epgen.bench.p2p": (("backends.cuda", "epgen.runtime.p2p_world"), "as epgen.bench.memory"),
    "epgen.bench.runner": (("backends.cuda", "epgen.runtime.world"), "as epgen.bench.memory"),
    "epgen.bench.timing": (("backends.cuda",), "as epgen.bench.memory"),
    "epgen.runtime.demo_runs": (("backends.cuda",), "cuda only when a demo runs"),
    "epgen.runtime.diagnostics": (("backends.cuda",), "decoding records needs no cuda"),
    "epgen.runtime.graph": (("backends.cuda",), "cuda only when a graph is captured"),
    "epgen.runtime.program": (("backends.cuda", "backends.nvptx"),
                              "llvmlite and cuda only when a program is built"),
}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if parts[-1] != "__main__":     # python -m epgen: runs the CLI
                mods[".".join(parts)] = path
    return mods


def _owner(name: str, mods) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _targets(module: str, is_pkg: bool, node, mods) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".") if is_pkg else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module
        names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in mods else prefix
                 for a in node.names]
    out = []
    for name in names:
        owner = _owner(name, mods)
        if owner is None or owner == module:
            continue
        out.append(owner)
        parts = owner.split(".")
        for i in range(1, len(parts)):      # importing a.b.c imports a and a.b first
            parent = ".".join(parts[:i])
            if parent in mods and parent != module and not module.startswith(parent + "."):
                out.append("^" + parent)    # implied, not written: marked for the allowlist
    return out


def import_graph():
    """(modules, {module: module-level imports}, {module: [(import, line)] inside functions})."""
    mods = _modules()
    top: dict[str, set[str]] = {m: set() for m in mods}
    local: dict[str, list[tuple[str, int]]] = {m: [] for m in mods}
    for module, path in mods.items():
        is_pkg = path.name == "__init__.py"

        def visit(node, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for t in _targets(module, is_pkg, child, mods):
                        if in_function:
                            local[module].append((t, child.lineno))
                        else:
                            top[module].add(t.lstrip("^"))
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    visit(child, True)
                elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    visit(ast.Module(body=child.orelse, type_ignores=[]), in_function)
                else:
                    visit(child, in_function)

        visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return mods, top, local


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (a list of modules, first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = dfs(w)
                if found:
                    return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state:
            found = dfs(v)
            if found:
                return found
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_graph_reader_sees_relative_and_local_imports():
    mods, top, local = import_graph()
    assert "backends.cuda.kernel" in top["backends.cuda.launch"]
    assert "epgen.bench.p2p" in top["epgen.bench.driver"]
    assert any(t == "epgen.kernels" for t, _ in local["epgen"])


def test_module_level_imports_are_acyclic():
    _, top, _ = import_graph()
    assert find_cycle(top) is None, " -> ".join(find_cycle(top))


def test_no_function_local_import_hides_a_cycle():
    _, top, local = import_graph()
    graph = {m: top[m] | {t.lstrip("^") for t, _ in local[m]} for m in top}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_function_local_imports_of_our_packages_are_allowlisted():
    mods, _, local = import_graph()
    bad = []
    for module, imports in local.items():
        allowed = LOCAL_IMPORTS.get(module, ((), ""))[0]
        bad += [f"{mods[module].relative_to(REPO)}:{line}: {t}" for t, line in imports
                if not t.startswith("^") and not any(t == a or t.startswith(a + ".") for a in allowed)]
    assert not bad, ("function-local imports of our own packages (import at module top, or "
                     "add the module to LOCAL_IMPORTS with the reason):\n" + "\n".join(bad))
    stale = sorted(m for m in LOCAL_IMPORTS if m not in mods or not local[m])
    assert not stale, f"LOCAL_IMPORTS entries without function-local imports: {stale}"


def test_every_module_imports():
    """In a fresh interpreter: each module of ir, backends and epgen imports (in sorted
    order, so a package is imported before its submodules are imported directly)."""
    mods = sorted(_modules())
    code = ("import importlib, sys\n"
            f"for m in {mods!r}:\n"
            "    importlib.import_module(m)\n"
            "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


def test_import_epgen_loads_nothing_heavy():
    """``import epgen`` is free: its names load on first use (PEP 562), so neither numpy nor
    the formats (ml_dtypes), llvmlite nor cuda.core come with it; the first use of a name
    loads its module."""
    code = ("import sys, epgen\n"
            "heavy = [m for m in ('numpy', 'ml_dtypes', 'llvmlite', 'cuda.core', 'epgen.config',\n"
            "                     'epgen.formats', 'epgen.runtime') if m in sys.modules]\n"
            "print(heavy)\n"
            "assert epgen.EPConfig.__name__ == 'EPConfig' and 'epgen.config' in sys.modules\n"
            "assert epgen.reference.__name__ == 'epgen.reference'\n"
            "assert 'EmulatedWorld' in dir(epgen) and 'epgen.runtime' not in sys.modules\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "[]"


# package -> packages it must never import (module level or inside functions): the layers of
# docs/design.md
FORBIDDEN = {
    "ir": ("backends", "epgen"),
    "backends.nvptx": ("backends.cuda", "epgen"),
    "backends.cuda": ("ir", "backends.nvptx", "epgen"),
    "epgen.kernels": ("epgen.runtime", "epgen.bench", "backends.cuda"),
    "epgen.runtime": ("epgen.bench",),
}


def test_imports_follow_the_layers():
    mods, top, local = import_graph()
    bad = []
    for module in mods:
        targets = top[module] | {t.lstrip("^") for t, _ in local[module]}
        for layer, banned in FORBIDDEN.items():
            if module == layer or module.startswith(layer + "."):
                bad += [f"{module} -> {t}" for t in sorted(targets)
                        if any(t == b or t.startswith(b + ".") for b in banned)]
    assert not bad, "\n".join(bad)


def test_building_the_cli_loads_no_configuration():
    """Every ``epgen`` start builds the whole parser (``epgen --help`` too): that must not
    import the configuration, the formats or their numeric libraries."""
    code = ("import sys, epgen.cli\n"
            "epgen.cli.build_parser()\n"
            "print([m for m in ('numpy', 'ml_dtypes', 'llvmlite', 'epgen.config', 'epgen.formats')\n"
            "       if m in sys.modules])\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "[]"
