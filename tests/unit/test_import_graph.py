"""The package's import graph has no cycle, counting imports inside functions too (a cycle hidden in a
function is still two modules that need each other to be understood)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in SRC.rglob("*.py")}
    assert "scalenlp.cli" in modules, f"the package is not under {SRC}"  # an empty graph would have no cycle
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                # an import of a.b.c needs a.b.c (or, for a name in a module, that module)
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith("scalenlp") and not name.startswith(t + "."):
                    graph[name].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_subpackages_are_layered():
    """No cycle between scalenlp's subpackages either (models, data, parallel, train, infer, plan): each
    needs only those below it."""
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        graph.setdefault(".".join(module.split(".")[:2]), set()).update(
            ".".join(t.split(".")[:2]) for t in targets if t.split(".")[:2] != module.split(".")[:2])
    for targets in list(graph.values()):
        for t in targets:
            graph.setdefault(t, set())
    cycle = find_cycle(graph)
    assert cycle is None, "subpackage cycle: " + " -> ".join(cycle)


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
