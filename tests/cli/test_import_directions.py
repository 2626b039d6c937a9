"""The package's import directions (docs/architecture.md): every ``import`` in dspark_trt, at module
level or inside a function, read with ``ast`` (nothing is imported). A unit is a sub-package or a
top-level module; it may import only the units its row names. Modules import each other without
cycles."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "dspark_trt"
BASE = {"config", "devices", "progress", "provenance", "interrupts", "atomic_write"}

# unit -> the units it may import (lower layers; arrows run one way)
ALLOWED = {
    "config": set(),
    "devices": {"config"},
    "progress": set(),
    "provenance": set(),
    "interrupts": set(),
    "atomic_write": set(),
    "plugins": {"atomic_write"},                               # ops know nothing of models
    "models": {"config", "plugins"},
    "parallel": {"config", "plugins", "models"},
    "checkpoints": {"config", "progress", "models", "parallel"},
    "engine": {"config", "plugins"},                           # the engine directory format
    "builder": BASE | {"plugins", "models", "parallel", "checkpoints", "engine"},   # never runtime
    "runtime": BASE | {"plugins", "models", "parallel", "checkpoints", "engine"},   # never builder
    "serving": BASE | {"parallel", "runtime"},                 # never commands
    "openai_server": BASE | {"parallel", "runtime"},           # never commands
    "train": BASE | {"plugins", "models", "checkpoints", "runtime"},
    "commands": BASE | {"plugins", "models", "parallel", "checkpoints", "engine", "builder", "runtime",
                        "serving", "openai_server", "train"},
    "cli": BASE | {"checkpoints", "engine", "builder", "runtime", "commands"},
    "(root)": {"runtime"},                                     # dspark_trt: LLM, SamplingParams
}


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict) -> set[str]:
    """The dspark_trt modules ``name`` imports (``from pkg import submodule`` counts as the submodule)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = name.split(".")[:None if path.name == "__init__.py" else -1]
                module = ".".join(base[:len(base) - node.level + 1] + ([module] if module else []))
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t.startswith("dspark_trt") and t != name:
                found.add(t)
    return found


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(root)"


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_every_unit_has_a_row():
    units = {unit(m) for m in modules()} - {"assets"}
    assert units <= set(ALLOWED), f"add a row to ALLOWED for {sorted(units - set(ALLOWED))}"


def test_imports_run_in_the_allowed_directions():
    bad = sorted(f"{a} -> {b}" for a, bs in graph().items() for b in bs
                 if unit(a) != unit(b) and unit(b) not in ALLOWED.get(unit(a), set()))
    assert not bad, "forbidden import direction(s):\n" + "\n".join(bad)


def test_no_import_cycles_between_modules():
    assert cycles(graph()) == []


def test_the_check_sees_a_forbidden_import(tmp_path):
    """The checker itself: runtime -> builder and a two-module circle are found."""
    g = {"dspark_trt.runtime.engine": {"dspark_trt.builder.export"}, "dspark_trt.builder.export": set(),
         "dspark_trt.parallel.tp": {"dspark_trt.parallel.v4"}, "dspark_trt.parallel.v4": {"dspark_trt.parallel.tp"}}
    assert unit("dspark_trt.builder.export") not in ALLOWED[unit("dspark_trt.runtime.engine")]
    assert cycles(g) == [["dspark_trt.parallel.tp", "dspark_trt.parallel.v4"]]
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from ..builder import export\n")
    assert imports("dspark_trt.runtime.m", src, {"dspark_trt.builder", "dspark_trt.builder.export"}) == \
        {"dspark_trt.builder.export"}
