"""The layout holds: imports go one way (eval -> kvpress -> patches), with no cycle and no import hidden
inside a function, and transformers internals are touched only in patches/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# where each installed package lives in the repository (pyproject's package-dir)
PACKAGES = {"kvpress.patches": "patches", "kvpress.eval": "eval", "kvpress": "kvpress"}
# entry points that load optional extras (lm-eval) on demand: they sit above everything they import
LAZY_ALLOWED = {"kvpress.cli", "kvpress.eval"}
# transformers modules outside its public top level: internals, patches/ only
INTERNAL = ("transformers.cache_utils", "transformers.masking_utils", "transformers.modeling_utils",
            "transformers.integrations", "transformers.models", "transformers.generation")  # fmt: skip


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()


def _layer(module: str) -> str:
    if module.startswith("kvpress.patches"):
        return "patches"
    if module.startswith("kvpress.eval") or module == "kvpress.cli":
        return "eval"
    return "kvpress"


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, at module level) for every import in `path`."""
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            out += [(name if name in MODULES else node.module, id(node) in top) for name in names]
    return out


def test_imports_go_one_way():
    order = {"patches": 0, "kvpress": 1, "eval": 2}
    wrong = []
    for module, path in MODULES.items():
        for imported, _ in _imports(path):
            if imported in MODULES and order[_layer(imported)] > order[_layer(module)]:
                wrong.append(f"{module} imports {imported}")
    assert not wrong, "imports must go eval -> kvpress -> patches:\n" + "\n".join(wrong)


def test_patches_import_nothing_of_kvpress_outside_patches():
    wrong = [f"{module} imports {imported}" for module, path in MODULES.items() if _layer(module) == "patches"
             for imported, _ in _imports(path) if imported.startswith("kvpress") and _layer(imported) != "patches"
             and imported != "kvpress"]  # fmt: skip
    assert not wrong, "\n".join(wrong)


def test_no_import_inside_a_function():
    hidden = [f"{module} imports {imported} inside a function" for module, path in MODULES.items()
              if module not in LAZY_ALLOWED for imported, top in _imports(path)
              if not top and imported.split(".")[0] == "kvpress"]  # fmt: skip
    assert not hidden, "\n".join(hidden)


def test_no_import_cycle():
    graph = {module: {imported for imported, top in _imports(path) if top and imported in MODULES}
             for module, path in MODULES.items()}  # fmt: skip
    # a submodule's import also runs its packages' __init__, but a package importing its own submodules
    # is the usual layout, not a cycle: only explicit imports count
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_transformers_internals_only_in_patches():
    wrong = [f"{module} imports {imported}" for module, path in MODULES.items() if _layer(module) != "patches"
             for imported, _ in _imports(path) if imported.startswith(INTERNAL)]  # fmt: skip
    private = [f"{module}: {needle}" for module, path in MODULES.items() if _layer(module) != "patches"
               for needle in ("_attn_implementation", "_global_mapping", "attn_logit_softcapping", ".scaling")
               if needle in path.read_text()]  # fmt: skip
    assert not wrong + private, "\n".join(wrong + private)
