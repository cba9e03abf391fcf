"""The house rules of issue 12, checked on the source: the project's modules import each other without a loop,
only at module level (optional heavy packages may stay lazy; project modules may not), and no line of code is
over 120 characters."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = {p.stem: p for p in ROOT.glob("*.py")}


def project_imports(path: Path):
    """-> [(module imported, line, at module level?)] for the imports of project modules in one file."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        names = ([a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import)
                 else [node.module.split(".")[0]] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                 else [])
        out += [(n, node.lineno, id(node) in top) for n in names if n in MODULES]
    return out


def test_no_project_import_inside_a_function():
    inner = [f"{name}.py:{line} imports {m}" for name, p in MODULES.items()
             for m, line, at_top in project_imports(p) if not at_top]
    assert not inner, inner


def test_the_import_graph_has_no_loop():
    graph = {name: {m for m, _, _ in project_imports(p) if m != name} for name, p in MODULES.items()}
    done, path = set(), []

    def visit(n):  # depth-first; a module met again on the current path closes a loop
        if n in path:
            raise AssertionError("import loop: " + " -> ".join(path[path.index(n):] + [n]))
        if n in done:
            return
        path.append(n)
        for m in sorted(graph[n]):
            visit(m)
        path.pop()
        done.add(n)
    for n in sorted(graph):
        visit(n)
    assert not [n for n in graph if "train_t1" in graph[n]]  # the loop file sits on top: nothing imports it


def test_lines_under_120_characters():
    long = [f"{p.relative_to(ROOT)}:{i}" for p in list(ROOT.glob("*.py")) + list((ROOT / "tests").glob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if len(line) > 120]
    assert not long, long
