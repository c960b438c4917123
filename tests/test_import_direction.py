"""The package's architecture, kept by reading its imports (ast), every import
counted, function-level ones included:

    proto, core.errors <- formats <- core <- devices, data <- lowering <- layers
          <- runtime <- training, testing <- cli <- cct's top-level pycaffe modules

A module may import its own subpackage and anything to its left; nothing
imports to its right, except the documented upward references below. And no
import circles anywhere. (core.errors is the leaf every part raises from;
formats parse files into caffe.proto messages, which the core's Net builds on.)"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder in the repository -> the package it installs as (setup.cfg's package_dir)
SOURCES = {"cct": "cct", "layers": "cct.layers", "lowering": "cct.lowering", "proto": "cct.proto"}
RANKS = {
    "cct.proto": 0, "cct.core.errors": 0, "cct.formats": 1, "cct.core": 2, "cct.devices": 3, "cct.data": 3,
    "cct.lowering": 4, "cct.layers": 5, "cct.runtime": 6, "cct.training": 7, "cct.testing": 7,
    "cct.cli": 8,
}
TOP_RANK = 9                      # cct/__init__ and pycaffe's module names: may import anything
ALLOWED_UPWARD = {
    ("cct.core.net", "cct.runtime.executor"),     # Net.executor, made lazily so Net.forward() just works
    ("cct.layers", "cct.net_spec"),               # pycaffe's `layers as L`: L.Convolution is NetSpec's factory
    ("cct.cli.tools", "cct.draw"),                # `cct draw` is Caffe's draw_net.py: it calls pycaffe's draw
}


def modules():
    """{dotted module name: source path} of every module the package installs."""
    found = {}
    for folder, package in SOURCES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package] + parts)] = path
    return found


def is_package(path):
    return path.name == "__init__.py"


def imported(name, path, known):
    """The cct modules that module `name` (at `path`) imports."""
    package = name if is_package(path) else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in known else base)
    return {target for target in targets if target in known}


def rank(name):
    for prefix, value in sorted(RANKS.items(), key=lambda item: -len(item[0])):
        if name == prefix or name.startswith(prefix + "."):
            return prefix, value
    return "cct", TOP_RANK


def violations(graph):
    wrong = []
    for name, targets in sorted(graph.items()):
        own_package, own_rank = rank(name)
        for target in sorted(targets):
            target_package, target_rank = rank(target)
            same_package = target_package == own_package
            if not same_package and target_rank >= own_rank and (name, target) not in ALLOWED_UPWARD:
                wrong.append(f"{name} (rank {own_rank}) imports {target} (rank {target_rank})")
    return wrong


def cycles(graph):
    """One list of modules per import circle found (depth-first search)."""
    found, state = [], {}

    def visit(name, stack):
        state[name] = "open"
        stack.append(name)
        for target in sorted(graph.get(name, ())):
            if state.get(target) == "open":
                found.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target, stack)
        stack.pop()
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    return found


def import_graph():
    known = modules()
    # a package's own __init__ importing its submodules is how packages work, not a circle
    return {name: {t for t in imported(name, path, known) if not (is_package(path) and t.startswith(name + "."))}
            for name, path in known.items()}


def test_imports_point_one_way():
    assert violations(import_graph()) == []


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_every_module_has_a_place():
    assert {rank(name)[0] for name in modules()} == set(RANKS) | {"cct"}
    assert rank("cct.core.errors") == ("cct.core.errors", 0) and rank("cct.core.blob") == ("cct.core", 2)


@pytest.mark.parametrize("source,target", [("cct.layers.conv", "cct.runtime.settings"),
                                           ("cct.lowering.type1", "cct.layers.conv"),
                                           ("cct.formats.weights", "cct.core.blob")])
def test_a_wrong_import_is_caught(source, target):
    graph = import_graph()
    graph[source] = graph[source] | {target}
    assert violations(graph) == [f"{source} (rank {rank(source)[1]}) imports {target} (rank {rank(target)[1]})"]


def test_a_circle_is_caught():
    graph = import_graph()
    graph["cct.lowering.chunking"] = graph["cct.lowering.chunking"] | {"cct.lowering.chooser"}
    assert ["cct.lowering.chooser", "cct.lowering.chunking", "cct.lowering.chooser"] in cycles(graph)
