"""The package's shape: no import cycle between modules nor between packages (lazy imports
included), nothing imports a layer above its own, and `algo/` imports nothing else of the
package.

A "package" here is a top-level unit of `cagrpo_ray`: a subpackage (`cagrpo_ray.env`) or a
top-level module (`cagrpo_ray.schedule`). Each sits in one layer of `LAYERS`; a module may
import its own package and the packages of the layers below, never one above, and another
package of its own layer only where `SAME_LAYER_IMPORTS` lists the pair (the package-cycle
check keeps those acyclic). A new package has to be given its layer here, and a new import
within a layer its line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parent.parent / "cagrpo_ray"

# `from cagrpo_ray import train`: the root package's one import, made when `train` is called.
ROOT_MAY_IMPORT = {"cagrpo_ray.api"}

# Lowest first. Each layer may import its own and the layers before it.
LAYERS: list[tuple[str, set[str]]] = [
    # the paper in code: pure torch, imports nothing of the package
    ("algorithm", {"algo"}),
    # records and utilities that every role shares (SamplingConfig, Completion, logging,
    # ending processes)
    ("foundation", {"types", "console", "progress", "processes", "imports", "errors"}),
    # a cluster of several Ray nodes on one machine (its own command; ends its processes)
    ("tools", {"local_cluster"}),
    # parts a role is built from, knowing no role: config, prompts, verifiers, environments,
    # the checkpoint directories
    (
        "components",
        {
            "config",
            "data",
            "rewards",
            "env",
            "metrics",
            "inspect",
            "policies",
            "placement",
            "checkpoints",
        },
    ),
    # the roles: generators and the buffer, learners, the weight sync; and the schedule, a
    # plain state machine (no Ray) low enough that the tools can drive it too
    ("roles", {"rollout", "learner", "sync", "schedule"}),
    # tools composed of roles: evaluation, the memory planner
    ("tools", {"eval", "plan"}),
    # the driver: the Ray loop that feeds the schedule, and the trainer that composes a run
    ("driver", {"driver"}),
    # the entry points: the command line (and its outer process) and the Python API
    ("entry", {"run", "api", "supervisor"}),
]

# The imports between two packages of the same layer, each with its reason; any other is an
# error, and so is a listed one that no module makes any more.
SAME_LAYER_IMPORTS: dict[tuple[str, str], str] = {
    ("env", "rewards"): "an episode's tools run code in the verifiers' sandbox",
    ("inspect", "rewards"): "the inspector marks responses whose reward had an error",
    ("policies", "data"): "a built-in policy is fine-tuned on worked solutions of its task",
    ("learner", "sync"): "learner rank 0 sends the weights",
    ("rollout", "sync"): "a generator replica receives the weights",
    ("schedule", "rollout"): "the schedule buffers scored groups and requeues lost chunks",
    ("run", "api"): "the command runs the Python API's training",
    ("run", "supervisor"): "the command's outer process supervises the driver",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_in(source: str, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """Package modules imported anywhere in `source`, the text of module `name` (at module
    level or inside functions)."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            # `from pkg import mod` imports the module pkg.mod when there is one
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {
        module_name(f): imports_in(f.read_text(), module_name(f), f.name == "__init__.py", modules)
        for f in files
    }


def package_of(module: str) -> str:
    """`cagrpo_ray.env.episode` -> `env`; `cagrpo_ray.schedule` -> `schedule`; the root
    package's `__init__` -> `cagrpo_ray`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package -> the other packages its modules import."""
    packages: dict[str, set[str]] = {}
    for node, edges in graph.items():
        here = package_of(node)
        packages.setdefault(here, set()).update(p for e in edges if (p := package_of(e)) != here)
    return packages


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph as a list of nodes, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def module_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle between modules. A module importing its own package (`env.episode` ->
    `env`, whose `__init__` imports `env.episode`) is not one: Python runs the package's
    `__init__` first, and it is the one that imports the module."""
    return find_cycle(
        {node: {n for n in edges if not node.startswith(n + ".")} for node, edges in graph.items()}
    )


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a package in a higher layer than the importer's, as "a -> b (layer x
    imports layer y)"; also each package that `LAYERS` does not place."""
    layer_of = {p: (i, layer) for i, (layer, packages) in enumerate(LAYERS) for p in packages}
    found = []
    for node, edges in sorted(graph.items()):
        here = package_of(node)
        if here == "cagrpo_ray":  # the root `__init__`: runs before every module of the package
            # ... so it imports nothing, except the Python API that its `train` loads lazily
            found += [
                f"{node} -> {e} (the root package imports nothing but the API, lazily)"
                for e in sorted(edges - ROOT_MAY_IMPORT)
            ]
            continue
        if here not in layer_of:
            found.append(f"{node}: package {here!r} has no layer in LAYERS")
            continue
        for edge in sorted(edges):
            there = package_of(edge)
            if there in (here, "cagrpo_ray"):  # its own package, or the root that runs first
                continue
            if there not in layer_of:
                found.append(f"{edge}: package {there!r} has no layer in LAYERS")
            elif layer_of[there][0] > layer_of[here][0]:
                found.append(f"{node} -> {edge} ({layer_of[here][1]} imports {layer_of[there][1]})")
    return found


def same_layer_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import between two packages of one layer that `SAME_LAYER_IMPORTS` does not list,
    as "a -> b (layer x)"; and each listed pair that no module imports any more."""
    layer_of = {p: layer for layer, packages in LAYERS for p in packages}
    pairs = {
        (here, there): layer_of[here]
        for here, edges in package_graph(graph).items()
        for there in edges
        if here in layer_of and there in layer_of and layer_of[here] == layer_of[there]
    }
    found = [
        f"{here} -> {there} ({layer}): list it in SAME_LAYER_IMPORTS with its reason, or import "
        "a lower layer"
        for (here, there), layer in sorted(pairs.items())
        if (here, there) not in SAME_LAYER_IMPORTS
    ]
    found += [
        f"{here} -> {there} is listed in SAME_LAYER_IMPORTS but no module imports it"
        for here, there in sorted(set(SAME_LAYER_IMPORTS) - set(pairs))
    ]
    return found


def algo_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import from `algo/` of another part of the package."""
    return [
        f"{node} -> {edge}"
        for node, edges in sorted(graph.items())
        if package_of(node) == "algo"
        for edge in sorted(edges)
        if package_of(edge) != "algo"
    ]


# The checks, each shown to fail on a graph that breaks its rule.


def test_the_import_reader_sees_lazy_and_relative_imports():
    modules = {"cagrpo_ray", "cagrpo_ray.rollout.pool", "cagrpo_ray.types", "cagrpo_ray.run"}
    source = "from .. import types\n\ndef main():\n    import cagrpo_ray.run\n"
    assert imports_in(source, "cagrpo_ray.rollout.pool", False, modules) == {
        "cagrpo_ray",
        "cagrpo_ray.types",
        "cagrpo_ray.run",
    }


def test_the_cycle_finder_finds_a_lazy_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_a_package_cycle_is_found_where_no_module_cycle_is():
    # env.episode -> rollout.types and rollout.generator -> env.episode: no module cycle,
    # but the packages import each other (the shape before types.py)
    graph = {
        "cagrpo_ray.env.episode": {"cagrpo_ray.rollout.types"},
        "cagrpo_ray.rollout.types": set(),
        "cagrpo_ray.rollout.generator": {"cagrpo_ray.env.episode"},
    }
    assert module_cycle(graph) is None
    assert find_cycle(package_graph(graph)) == ["env", "rollout", "env"]


def test_an_upward_import_is_found():
    graph = {
        "cagrpo_ray.rollout.pool": {"cagrpo_ray.driver.loop", "cagrpo_ray.env", "cagrpo_ray.types"},
        "cagrpo_ray.newpart": set(),
        "cagrpo_ray": {"cagrpo_ray.run"},
    }
    assert upward_imports(graph) == [
        "cagrpo_ray -> cagrpo_ray.run (the root package imports nothing but the API, lazily)",
        "cagrpo_ray.newpart: package 'newpart' has no layer in LAYERS",
        "cagrpo_ray.rollout.pool -> cagrpo_ray.driver.loop (roles imports driver)",
    ]


def test_a_same_layer_import_not_listed_is_found():
    graph = {
        "cagrpo_ray.sync.sender": {"cagrpo_ray.rollout.pool"},  # roles -> roles, not listed
        "cagrpo_ray.rollout.generator": {"cagrpo_ray.sync.receiver"},  # listed
        "cagrpo_ray.learner.learner": {"cagrpo_ray.sync.sender", "cagrpo_ray.algo.losses"},
    }
    found = same_layer_imports(graph)
    assert found[0] == (
        "sync -> rollout (roles): list it in SAME_LAYER_IMPORTS with its reason, or import a "
        "lower layer"
    )
    listed_but_absent = {pair for pair in SAME_LAYER_IMPORTS} - {
        ("rollout", "sync"), ("learner", "sync")
    }  # fmt: skip
    assert len(found) == 1 + len(listed_but_absent)


def test_an_import_from_algo_is_found():
    graph = {"cagrpo_ray.algo.losses": {"cagrpo_ray.algo.stats", "cagrpo_ray.types"}}
    assert algo_imports(graph) == ["cagrpo_ray.algo.losses -> cagrpo_ray.types"]


# The checks on the package itself.


def test_every_package_has_one_layer():
    placed = [p for _, packages in LAYERS for p in packages]
    assert len(placed) == len(set(placed)), placed
    present = set(package_graph(import_graph())) - {"cagrpo_ray"}
    assert not present - set(placed), f"give these a layer in LAYERS: {present - set(placed)}"


def test_no_import_cycle_between_modules():
    cycle = module_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_no_import_cycle_between_packages():
    cycle = find_cycle(package_graph(import_graph()))
    assert cycle is None, " -> ".join(cycle)


def test_nothing_imports_upward():
    upward = upward_imports(import_graph())
    assert not upward, "\n".join(upward)


def test_imports_within_a_layer_are_the_listed_ones():
    found = same_layer_imports(import_graph())
    assert not found, "\n".join(found)


def test_algo_is_the_paper_alone():
    found = algo_imports(import_graph())
    assert not found, "\n".join(found)
