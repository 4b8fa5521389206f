"""The import graph of ``lra_cond`` (read with ``ast``, nothing imported): no circles, and arrows
that run one way: cli -> training -> callbacks -> conditioning -> models/init; report reads run folders.

Every import statement counts, at module level or inside a function (a function-level import is
still a dependency, only a later one). An edge goes to the module the statement names (``from
lra_cond.init import INITS`` -> ``lra_cond.init``, the package's ``__init__``); that importing
``a.b`` also runs ``a/__init__`` is not counted, or every package whose ``__init__`` imports its
own modules would be a circle."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def module_files() -> dict[str, Path]:
    files = {}
    # The top-level data_prep/ folder is the package lra_cond.data_prep (see lra_cond/data_prep/).
    for root, name in ((REPO / "lra_cond", "lra_cond"), (REPO / "data_prep", "lra_cond.data_prep")):
        for path in root.rglob("*.py"):
            parts = [name, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            files.setdefault(".".join(parts), path)  # data_prep/__init__.py over the checkout's pointer
    return files


def import_graph() -> dict[str, set[str]]:
    files = module_files()

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {known(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base])
                for alias in node.names:  # `from pkg import module` names the module
                    full = f"{base.strip('.')}.{alias.name}"
                    targets.add(full if full in files else known(base.strip(".")))
        graph[module] = {t for t in targets if t and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def imports_of(prefix: str) -> dict[str, set[str]]:
    return {m: t for m, t in import_graph().items() if m == prefix or m.startswith(prefix + ".")}


def under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_graph_is_read():
    graph = import_graph()
    assert "lra_cond.training.module" in graph["lra_cond.training.lightning_cli"]
    assert "lra_cond.data_prep.listops" in graph["lra_cond.data.tasks"]  # a function-level import
    assert "lra_cond.errors" in graph["lra_cond.data_prep.listops"]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_report_reads_run_folders_only():
    for module, targets in imports_of("lra_cond.report").items():
        bad = {t for t in targets if under(t, "lra_cond.callbacks", "lra_cond.cli", "lra_cond.training")}
        assert not bad, f"{module} imports {bad}"


def test_arrows_run_one_way():
    above = {
        # what each layer may not import: the layers above it
        "lra_cond.models": ("lra_cond.init", "lra_cond.callbacks", "lra_cond.training", "lra_cond.cli"),
        "lra_cond.init": ("lra_cond.callbacks", "lra_cond.training", "lra_cond.cli", "lra_cond.conditioning"),
        "lra_cond.conditioning": ("lra_cond.init", "lra_cond.callbacks", "lra_cond.training", "lra_cond.cli"),
        "lra_cond.callbacks": ("lra_cond.training", "lra_cond.cli", "lra_cond.report"),
        "lra_cond.data": ("lra_cond.models", "lra_cond.init", "lra_cond.training", "lra_cond.cli"),
        "lra_cond.data_prep": ("lra_cond.data", "lra_cond.models", "lra_cond.training", "lra_cond.cli"),
        "lra_cond.training": ("lra_cond.cli",),
    }
    for layer, forbidden in above.items():
        for module, targets in imports_of(layer).items():
            bad = {t for t in targets if under(t, *forbidden)}
            assert not bad, f"{module} imports {bad}"


def test_init_sees_only_the_attention_contract():
    for module, targets in imports_of("lra_cond.init").items():
        models = {t for t in targets if under(t, "lra_cond.models")}
        assert models <= {"lra_cond.models.attention.base"}, f"{module} imports {models}"


def test_only_main_imports_the_cli():
    users = {m for m, targets in import_graph().items() if "lra_cond.cli" in targets}
    assert users == {"lra_cond.__main__"}
