"""The import graph of flows/, tasks/ and storage/, read with `ast` (module-level and function-level
imports alike, so a lazy import inside a function cannot hide a cycle): no cycle, dependencies point
one way (flows -> tasks -> storage), and the subsystems of tasks/ depend on one another only along the
edges listed in ALLOWED, each with its reason."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAYERS = {"storage": 0, "tasks": 1, "flows": 2}  # an import may point down or sideways, never up

# (from subsystem, to subsystem): why the one may import the other. Every tasks/ subsystem folder not
# listed here stays out of every other's imports; shared pieces live in tasks/'s top-level modules.
# Together they run one way: learner -> push -> rollouts -> rewards, and each -> config.
ALLOWED = {
    # The config sections are data (pydantic models, no behaviour): each unit takes its own section.
    **{
        (s, "config"): "each unit takes its own config section"
        for s in ("rollouts", "rewards", "learner", "push")
    },
    # The learner writes its weights in the one format the server loads (push/weights.py's writer).
    ("learner", "push"): "a learner saves its weights as the push's model dir",
    # A push talks to the inference servers through rollouts' client (VLLMClient, replicas, cache salt).
    ("push", "rollouts"): "a push reaches the servers through the rollouts' inference client",
    # An environment's episode ends in its reward: multi-turn and verifiers rollouts return the outcome
    # that rewards/ scores (env_reward, vf_reward); rewards/ never imports rollouts/.
    ("rollouts", "rewards"): "an environment's rollout carries the outcome its reward scores",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("grpoflow", *parts))


def import_graph() -> dict[str, set[str]]:
    """Each module of the three packages -> the modules of the three it imports, anywhere in its body."""
    files = {module_name(p): p for top in LAYERS for p in (REPO / top).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1 packages
                    up = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{up}.{base}" if base else up
                # `from pkg import mod` imports the module pkg.mod when there is one, else names of pkg
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def layer(module: str) -> int:
    return LAYERS[module.split(".")[1]]


def subsystem(module: str) -> str | None:
    """The tasks/ subsystem folder a module is in; None for tasks/'s top-level modules and the rest."""
    parts = module.split(".")
    return parts[2] if parts[1] == "tasks" and len(parts) > 3 else None


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as the list of its modules (first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


@pytest.mark.unit
def test_the_graph_is_read():
    graph = import_graph()
    # the known edges are seen, a function-level one included (check_trackers inside preflight)
    assert "grpoflow.tasks.group_signal" in graph["grpoflow.tasks.rollouts.sampling"]
    assert "grpoflow.flows.viewing.tracking" in graph["grpoflow.flows.training.preflight"]
    assert "grpoflow.flows.config" in graph["grpoflow.flows.training.environments"]


@pytest.mark.unit
def test_no_import_cycle():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()) or [])


@pytest.mark.unit
def test_find_cycle_sees_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.unit
def test_dependencies_point_down():
    graph = import_graph()
    up = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer(b) > layer(a))
    assert not up, "imports that point up (flows -> tasks -> storage):\n" + "\n".join(up)


@pytest.mark.unit
def test_tasks_subsystems_import_one_another_only_as_allowed():
    graph = import_graph()
    across = sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if subsystem(a)
        and subsystem(b)
        and subsystem(a) != subsystem(b)
        and (subsystem(a), subsystem(b)) not in ALLOWED
    )
    assert not across, (
        "tasks/ subsystems importing one another (add to ALLOWED with a reason?):\n" + "\n".join(across)
    )
