"""The package's import graph holds the layout's rules, counting imports inside functions too (a cycle hidden in a
function is still two modules that need each other to be understood):

- no cycle between modules, nor between subpackages;
- nothing imports a command module (``scalenlp.cli``): commands parse and print, the library does the work;
- the inference side (``engine``, ``serving``) never imports training (``train``);
- the models are plain PyTorch: ``models`` never imports ``torch.distributed`` (parallelism lives in ``parallel``).
"""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    found = {module_name(p): p for p in SRC.rglob("*.py")}
    assert "scalenlp.cli" in found, f"the package is not under {SRC}"  # an empty graph would have no cycle
    return found


def raw_imports(name: str, path: Path) -> list[str]:
    """Every dotted name the module imports, anywhere in it (module level or inside a function), made absolute;
    ``from a import b`` gives both ``a`` and ``a.b``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets += [base] + [f"{base}.{a.name}" for a in node.names]
    return targets


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    for name, path in known.items():
        for t in raw_imports(name, path):
            # an import of a.b.c needs a.b.c (or, for a name in a module, that module)
            while t and t not in known:
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
    """No cycle between scalenlp's subpackages either (models, compress, data, parallel, train, engine, serving,
    plan, cli): each needs only those below it."""
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        graph.setdefault(".".join(module.split(".")[:2]), set()).update(
            ".".join(t.split(".")[:2]) for t in targets if t.split(".")[:2] != module.split(".")[:2])
    for targets in list(graph.values()):
        for t in targets:
            graph.setdefault(t, set())
    cycle = find_cycle(graph)
    assert cycle is None, "subpackage cycle: " + " -> ".join(cycle)


def importers_of(prefix: str, among: str = "scalenlp") -> list[str]:
    """``module -> target`` for each module under ``among`` that imports ``prefix`` or something under it."""
    return [f"{name} -> {t}" for name, path in modules().items() if name == among or name.startswith(among + ".")
            for t in raw_imports(name, path) if t == prefix or t.startswith(prefix + ".")]


def test_nothing_imports_the_commands():
    offenders = [line for line in importers_of("scalenlp.cli")
                 if not line.startswith(("scalenlp.cli ", "scalenlp.cli.", "scalenlp.__main__ "))]
    assert offenders == [], "the library imports a command module: " + "; ".join(offenders)


def test_inference_never_imports_training():
    offenders = importers_of("scalenlp.train", "scalenlp.engine") + importers_of("scalenlp.train", "scalenlp.serving")
    assert offenders == [], "inference imports training: " + "; ".join(offenders)


def test_models_are_plain_pytorch():
    offenders = importers_of("torch.distributed", "scalenlp.models")
    assert offenders == [], "a model module imports torch.distributed: " + "; ".join(offenders)


def test_the_rules_see_imports_inside_functions(tmp_path):
    """The checks read nested and relative imports: a rule broken inside a function is still found."""
    module = tmp_path / "scalenlp" / "engine" / "x.py"
    module.parent.mkdir(parents=True)
    module.write_text("def f():\n    from ..train import trainer\n    import torch.distributed as dist\n")
    assert set(raw_imports("scalenlp.engine.x", module)) >= {"scalenlp.train", "scalenlp.train.trainer",
                                                                "torch.distributed"}


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
