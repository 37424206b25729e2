"""The import graph, read from the source (AST, no tool): no circles, imports run one way
between the gateway's subpackages, and ``backends`` never imports ``gateway``. And sizes:
a module you can hold in your head (400 lines), a function too (50, declarative tables
excepted by name)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Floors, lowest first: a module may import its own subpackage and any lower floor.
FLOORS: list[set[str]] = [
    {"backends"},
    {"config", "errors", "types", "metrics"},  # the leaves
    {"http", "state", "kv"},
    {"upstream", "resilience", "tenants"},
    {"routing"},
    {"canary"},
    {"observability"},
    {"request"},  # a request parsed, its one Redis round trip, its plan
    {"reply"},  # an attempt's reply opened, relayed, continued, rescued
    {"batch"},  # the Files and Batches APIs, and the runner that sends lines to the proxy
    {"admin"},
    # the front door; control/ holds the control plane (cli hands it what build made)
    {"app", "build", "cli", "control", "lifespan", "proxy", "workers", "__main__", "__init__"},
]
FLOOR = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 50
TABLES = {"gateway/metrics.py:Metrics.__init__"}  # the metric catalogue, one entry per metric
SUBPACKAGES = {"config", "http", "state", "kv", "upstream", "resilience", "tenants", "routing",
               "canary", "observability", "request", "reply", "batch", "admin"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, known: set[str]) -> set[str]:
    """The modules of ours that ``path`` imports: ``from x import y`` counts as x.y when that
    is a module (a submodule, not the package's ``__init__``), else as x."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in known else node.module)
    return out & known


def graph() -> dict[str, set[str]]:
    files = [p for d in ("gateway", "backends") for p in (REPO / d).rglob("*.py")]
    names = {module_name(p): p for p in files}
    return {name: imports(path, set(names)) - {name} for name, path in names.items()}


def room(module: str) -> str:
    """The part of the house a module stands in: a gateway subpackage or top module."""
    parts = module.split(".")
    if parts[0] == "backends":
        return "backends"
    return parts[1] if len(parts) > 1 else "__init__"


def wrong_way(edges: dict[str, set[str]]) -> list[str]:
    """Imports between rooms that run up, or sideways between subpackages of one floor
    (top modules of one floor, the leaves or the front door, may import each other)."""
    return sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets
                  if room(a) != room(b) and (
                      FLOOR[room(b)] > FLOOR[room(a)]
                      or (FLOOR[room(b)] == FLOOR[room(a)] and room(a) in SUBPACKAGES)))


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    found: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                found.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


def test_every_module_has_a_floor() -> None:
    assert sorted({room(m) for m in graph()} - FLOOR.keys()) == []


def test_no_import_runs_up_or_sideways_between_subpackages() -> None:
    assert wrong_way(graph()) == []


def test_backends_never_imports_gateway() -> None:
    edges = graph()
    assert sorted(f"{a} -> {b}" for a, targets in edges.items() if room(a) == "backends"
                  for b in targets if b.startswith("gateway")) == []


def test_no_circles() -> None:
    assert circles(graph()) == []


def test_the_checks_can_fail() -> None:
    """Each check on a small made-up graph that breaks it."""
    up = {"gateway.state.link": {"gateway.routing.pins"}, "gateway.routing.pins": set()}
    side = {"gateway.http.auth": {"gateway.state.link"}, "gateway.state.link": set()}
    fine = {"gateway.proxy": {"gateway.routing.router"}, "gateway.cli": {"gateway.app"},
            "gateway.routing.router": {"gateway.routing.pool"}, "gateway.routing.pool": set()}
    assert wrong_way(up) == ["gateway.state.link -> gateway.routing.pins"]
    assert wrong_way(side) == ["gateway.http.auth -> gateway.state.link"]
    assert wrong_way(fine) == []
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def too_long(path: Path, root: Path = REPO) -> list[str]:
    """``path:Qualified.name (lines)`` for each function over the limit, and the module."""
    text = path.read_text()
    where = path.relative_to(root).as_posix()
    out = [f"{where} ({n} lines)" for n in [len(text.splitlines())] if n > MAX_MODULE_LINES]

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{where}:{prefix}{child.name}"
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                if lines > MAX_FUNCTION_LINES and name not in TABLES:
                    out.append(f"{name} ({lines} lines)")
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(text, str(path)), "")
    return out


def test_modules_and_functions_stay_small() -> None:
    sources = sorted((REPO / "gateway").rglob("*.py")) + sorted((REPO / "backends").rglob("*.py"))
    assert [entry for path in sources for entry in too_long(path)] == []


def test_the_size_check_can_fail(tmp_path: Path) -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    long = tmp_path / "long.py"
    long.write_text(f"class A:\n    def f(self) -> None:\n{body}\n" + "\n" * 400)
    short = tmp_path / "short.py"
    short.write_text("def f() -> None:\n    pass\n")
    assert too_long(long, tmp_path) == [
        "long.py (452 lines)", f"long.py:A.f ({MAX_FUNCTION_LINES + 1} lines)"]
    assert too_long(short, tmp_path) == []


def test_the_top_of_gateway_holds_at_most_twelve_modules() -> None:
    """What is not the front door or a leaf lives in a room named for what it holds."""
    flat = sorted(p.name for p in (REPO / "gateway").glob("*.py"))
    assert len(flat) <= 12, flat
