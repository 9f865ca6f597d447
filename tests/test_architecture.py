"""The dependency rules of the source tree, checked on its import statements (read with ast, nothing imported).

    python -m pytest tests/test_architecture.py     # the command that checks the rules below
"""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the package it installs as (pyproject's package-dir)
FOLDERS = {"moecompile": "moecompile", "kernels": "moecompile.kernels", "passes": "moecompile.passes",
           "runtime": "moecompile.runtime", "examples": "moecompile.examples"}


def _modules() -> dict[str, Path]:
    modules = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            modules[".".join([package, *parts])] = path
    return modules


def _imported(module: str, path: Path, modules: dict[str, Path]):
    """(imported module of this tree, the ast node, the alias) for every import in the file, function-level ones
    included."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [(a.name, a) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names = [(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base, a) for a in node.names]
        else:
            continue
        for name, alias in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                yield name, node, alias


@pytest.fixture(scope="module")
def graph() -> nx.DiGraph:
    modules = _modules()
    g = nx.DiGraph()
    for module, path in modules.items():
        g.add_node(module, path=path)
        for target, node, _ in _imported(module, path, modules):
            g.add_edge(module, target, line=node.lineno)
    return g


def test_tree_is_read(graph):
    assert {"moecompile.ir.ops", "moecompile.kernels.reference", "moecompile.passes.pipeline",
            "moecompile.runtime.registry"} <= set(graph)


def test_no_import_cycles(graph):
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def _package(module: str, graph: nx.DiGraph) -> str:
    """The package a module belongs to: a subpackage of moecompile (moecompile.ir, moecompile.passes, ...), or the
    top-level module itself (moecompile.cli, moecompile.backend, ...)."""
    parts = module.split(".")
    if len(parts) > 2 or graph.nodes[module]["path"].name == "__init__.py":
        return ".".join(parts[:2])
    return module


@pytest.fixture(scope="module")
def packages(graph) -> nx.DiGraph:
    g = nx.DiGraph()
    for src, dst, line in graph.edges(data="line"):
        a, b = _package(src, graph), _package(dst, graph)
        if a != b:
            g.add_edge(a, b)
            g.edges[a, b].setdefault("why", []).append(f"{src}:{line} -> {dst}")
    return g


def test_no_package_cycles(packages):
    """Packages form layers: core < kernels < runtime < ir < io < parallel < ffn < passes < calibration <
    conversion (docs/architecture.md); an import against that direction shows as a cycle here."""
    assert {"moecompile.core", "moecompile.ir", "moecompile.parallel", "moecompile.ffn"} <= set(packages)
    cycles = list(nx.simple_cycles(packages))
    assert not cycles, "; ".join(" -> ".join(c) + " (" + ", ".join(
        packages.edges[a, b]["why"][0] for a, b in zip(c, c[1:] + c[:1])) + ")" for c in cycles)


def _private_uses(module: str, path: Path, modules: dict[str, Path]):
    """(line, module of the tree, name) for each `_name` (dunders excepted) this file imports from another module of
    the tree, or reads as an attribute of a module of the tree it imported."""
    aliases = {}  # local name -> the module of the tree it is bound to
    for target, node, a in _imported(module, path, modules):
        if isinstance(node, ast.Import):
            if a.asname and a.name == target:
                aliases[a.asname] = target
        elif target.endswith(f".{a.name}"):  # a module imported from its package
            aliases[a.asname or a.name] = target
        elif a.name.startswith("_") and not a.name.startswith("__"):
            yield node.lineno, target, a.name
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            yield node.lineno, aliases[node.value.id], node.attr


def test_no_private_name_crosses_a_package(graph):
    modules = _modules()
    wrong = [f"{module}:{line} uses {target}.{name}" for module, path in graph.nodes(data="path")
             for line, target, name in _private_uses(module, path, modules)
             if _package(target, graph) != _package(module, graph)]
    assert not wrong, wrong


def test_kernels_are_imported_by_the_runtime_only(graph):
    wrong = [f"{src} (line {graph.edges[src, dst]['line']}) imports {dst}" for src, dst in graph.edges
             if dst.startswith("moecompile.kernels.")
             and not src.startswith(("moecompile.kernels.", "moecompile.runtime."))]
    assert not wrong, wrong


def test_kernels_are_leaves(graph):
    """Kernels import other kernels and the leaf definitions of moecompile.core (activations, FP8 format, settings)."""
    core = {m for m in graph if m.startswith("moecompile.core.")}
    assert {"moecompile.core.activations", "moecompile.core.fp8_format", "moecompile.core.settings"} <= core
    for leaf in core:
        assert not [dst for dst in graph.successors(leaf) if not dst.startswith("moecompile.core.")], \
            f"{leaf} must import nothing of moecompile outside moecompile.core"
    wrong = [f"{src} imports {dst}" for src, dst in graph.edges
             if src.startswith("moecompile.kernels.")
             and not dst.startswith(("moecompile.kernels.", "moecompile.core."))]
    assert not wrong, wrong


def test_passes_never_import_kernels_or_runtime(graph):
    wrong = [f"{src} imports {dst}" for src, dst in graph.edges if src.startswith("moecompile.passes.")
             and dst.startswith(("moecompile.kernels.", "moecompile.runtime."))]
    assert not wrong, wrong


def test_environment_is_read_in_settings_only(graph):
    """Every environment variable the product reads is read in moecompile/core/settings.py."""
    wrong = []
    for module, path in graph.nodes(data="path"):
        if module == "moecompile.core.settings":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv") and \
                    isinstance(node.value, ast.Name) and node.value.id == "os":
                wrong.append(f"{module}:{node.lineno}")
    assert not wrong, wrong


@pytest.mark.parametrize("first", ["moecompile.core.activations", "moecompile.runtime.registry"])
def test_a_leaf_imports_first_in_a_fresh_interpreter(first):
    """Importing torch registers the ops; that must not re-enter a module of ours that is itself importing."""
    import subprocess
    import sys

    code = f"import {first}; import moecompile, torch; moecompile.MoEBlock; assert torch.ops.moecompile.route"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]


def test_every_subpackage_is_installed():
    """pyproject's package list names every package of the tree (a wheel leaves out one it does not name)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "moecompile").rglob("__init__.py")}
    found |= {package for folder, package in FOLDERS.items() if folder != "moecompile"}
    assert found <= listed, sorted(found - listed)


def test_only_the_mapped_folders_are_subpackages_of_a_checkout():
    """From a source checkout moecompile.kernels / passes / runtime / examples are its folders; tests/ and bench/ are
    not importable as moecompile.tests or moecompile.bench."""
    import subprocess
    import sys

    code = ("import importlib.util as u, moecompile, moecompile.kernels, moecompile.passes, moecompile.runtime; "
            "print(u.find_spec('moecompile.tests'), u.find_spec('moecompile.bench'), "
            "*(list(m.__path__)[0] for m in (moecompile.kernels, moecompile.passes, moecompile.runtime)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["None", "None", *(str(ROOT / f) for f in ("kernels", "passes", "runtime"))]


@pytest.mark.parametrize("read, name, allowed", [("ffn_in", "MOECOMPILE_FFN_IN", "quack"),
                                                 ("fold_combine", "MOECOMPILE_FOLD_COMBINE", "off"),
                                                 ("fp8_block_kernel", "MOECOMPILE_FP8_BLOCK_KERNEL", "gluon")])
def test_a_kernel_setting_outside_its_values_is_a_clear_error(monkeypatch, read, name, allowed):
    from moecompile.core import settings
    from moecompile.core.errors import MoECompileError

    monkeypatch.setenv(name, allowed)
    assert getattr(settings, read)() == allowed
    monkeypatch.setenv(name, "yes")
    with pytest.raises(MoECompileError, match=f"^{name}='yes': expected one of auto, "):
        getattr(settings, read)()
    monkeypatch.delenv(name)
    assert getattr(settings, read)() == "auto"
