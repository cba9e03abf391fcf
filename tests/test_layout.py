"""The house rules, checked on the source: the top level is the paper and the machinery sits in folders below it;
the project's modules import each other without a loop, only at module level (optional heavy packages may stay
lazy; project modules may not), each from the floors below it; no line of code is over 120 characters."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "sandbox", "cluster", "tasks", "experiments")  # the machinery, by what it is
MODULES = {p.stem: p for p in ROOT.glob("*.py")}
MODULES.update({f"{pkg}.{p.stem}": p for pkg in PACKAGES for p in (ROOT / pkg).glob("*.py") if p.stem != "__init__"})
# the paper's modules (DESIGN.md section 2) and the few small files the loop needs
TOP_LEVEL = {"train_t1", "ppo", "critic", "rollout", "terminus2", "tito", "r3", "reward", "data", "infra", "model",
             "trainer", "rundir", "runstate", "dp", "report", "chat_tokens"}


def resolve(node) -> list[str]:
    """The project modules one import statement names ('engine.server' for `from engine import server`)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in MODULES or a.name.split(".")[0] in MODULES]
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        if node.module in PACKAGES:
            return [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES]
        return [node.module] if node.module in MODULES else []
    return []


def project_imports(path: Path):
    """-> [(module imported, line, at module level?)] for the imports of project modules in one file."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(n) for n in tree.body}
    return [(m, node.lineno, id(node) in top) for node in ast.walk(tree) for m in resolve(node)]


GRAPH = {name: {m for m, _, _ in project_imports(p) if m != name} for name, p in MODULES.items()}


def test_the_top_level_is_the_paper():
    assert set(m for m in MODULES if "." not in m) <= TOP_LEVEL, set(m for m in MODULES if "." not in m) - TOP_LEVEL
    assert all((ROOT / pkg / "__init__.py").exists() for pkg in PACKAGES)


def test_no_project_import_inside_a_function():
    inner = [f"{name}: line {line} imports {m}" for name, p in MODULES.items()
             for m, line, at_top in project_imports(p) if not at_top]
    assert not inner, inner


def test_the_import_graph_has_no_loop():
    done, path = set(), []

    def visit(n):  # depth-first; a module met again on the current path closes a loop
        if n in path:
            raise AssertionError("import loop: " + " -> ".join(path[path.index(n):] + [n]))
        if n in done:
            return
        path.append(n)
        for m in sorted(GRAPH[n]):
            visit(m)
        path.pop()
        done.add(n)
    for n in sorted(GRAPH):
        visit(n)
    # the loop file sits on top: only the experiments, which measure it, import it
    assert not [n for n in GRAPH if "train_t1" in GRAPH[n] and not n.startswith("experiments.")]


def test_the_entry_point_and_the_machinery_import_no_experiment():
    """Experiments measure the code; nothing outside experiments/ depends on them (train_t1 included)."""
    bad = [f"{n} imports {m}" for n, deps in GRAPH.items() if not n.startswith("experiments.")
           for m in deps if m.startswith("experiments.")]
    assert not bad, bad


def test_lines_under_120_characters():
    files = [p for p in MODULES.values()] + list((ROOT / "tests").glob("*.py"))
    long = [f"{p.relative_to(ROOT)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
            if len(line) > 120]
    assert not long, long


def test_no_module_over_600_lines():
    """A file that passes ~600 lines is split by idea (the design card's rule); tests are exempt."""
    big = {name: n for name, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 600}
    assert not big, big


def test_code_and_docs_name_things_by_date_and_topic():
    """No sitting numbers, tracker numbers or run nicknames in code, tests or docs (results/LOG.md names runs by date
    and topic; the code says what and why, not when)."""
    pattern = re.compile(r"\b(issue|tracker) #?\d+\b|\bsitting\b|\b(twenty|thirty)-\w+ (session|sitting)\b|\brun s\d\b",
                         re.IGNORECASE)
    files = (list(MODULES.values()) + list((ROOT / "tests").glob("*.py")) + list(ROOT.glob("*.md"))
             + list((ROOT / "docs").glob("*.md")) + [ROOT / "results" / "LOG.md", ROOT / "run.sh"])
    hits = [f"{p.relative_to(ROOT)}:{i}: {m.group(0)}" for p in files if p.exists()
            if p != Path(__file__).resolve() for i, line in enumerate(p.read_text().splitlines(), 1)
            if (m := pattern.search(line))]
    assert not hits, hits
