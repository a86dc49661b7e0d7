"""The house as the imports draw it: the core imports no stage, no stage imports another, and no
module is part of an import cycle — counting every import: top-level, inside functions, under
TYPE_CHECKING, and ``importlib.import_module``/``__import__`` of a literal name. The core must not
even spell a stage's module name outside docstrings (the CLI finds stages through entry points)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {"pdm_lab": "pdm_lab", "envs": "pdm_lab.envs", "scaling": "pdm_lab.scaling", "proofs": "pdm_lab.proofs"}
STAGES = ("pdm_lab.envs", "pdm_lab.scaling", "pdm_lab.proofs")


def modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            if parts[0] in ("envs", "scaling", "proofs") and folder == "pdm_lab":
                continue  # not a real subfolder of the core (the stages live at the top level)
            name = ".".join((package, *parts))
            out[name.removesuffix(".__init__")] = path
    return out


MODULES = modules()


def stage_of(module: str) -> str:
    return next((s for s in STAGES if module == s or module.startswith(s + ".")), "core")


def imports_of(module: str, path: Path) -> set[str]:
    """Every project module ``module`` imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    package = module if path.stem == "__init__" else module.rsplit(".", 1)[0]  # what `.` means here
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = {f"{target}.{alias.name}" for alias in node.names} & set(MODULES)
            found |= subs
            if len(subs) < len(node.names):
                found.add(target)
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                found.add(str(node.args[0].value))
    return {m for m in found if m in MODULES and m != module}


GRAPH = {m: imports_of(m, p) for m, p in MODULES.items()}


def test_the_analysis_sees_all_kinds_of_import():
    assert "pdm_lab.masks" in GRAPH["pdm_lab.mask_config"]  # top level
    assert "pdm_lab.tokenwise" in GRAPH["pdm_lab.metrics"] or "pdm_lab.masks" in GRAPH["pdm_lab.metrics"]
    assert "pdm_lab.envs.pipeline" in GRAPH["pdm_lab.envs.commands"]  # inside a function
    assert len(MODULES) > 60


def test_core_imports_no_stage_and_stages_import_no_other_stage():
    wrong = [f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps
             if stage_of(d) != "core" and stage_of(d) != stage_of(m)]
    assert not wrong, wrong


def test_core_does_not_name_a_stage_module_outside_docstrings():
    named = []
    for module, path in MODULES.items():
        if stage_of(module) != "core":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                    and any(stage in node.value for stage in STAGES)):
                named.append(f"{module}: {node.value!r}")
    assert not named, named


def test_no_import_cycle():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
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
                cycles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not cycles, cycles


#: ``envs`` packages bottom up; a module imports only its own package, those before it, and the core.
ENVS_LAYERS = ("problems", "policies", "train", "audit", "transfer", "sweep", "report")


def envs_layer(module: str) -> int:
    """A module's floor in ``envs``: its package's place in ``ENVS_LAYERS``, or the top level
    (``presets``, ``pipeline``, ``commands``, ``bench``, …) above them all."""
    part = module.removeprefix("pdm_lab.envs").lstrip(".").split(".")[0]
    return ENVS_LAYERS.index(part) if part in ENVS_LAYERS else len(ENVS_LAYERS)


def upward_envs_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{m} -> {d}" for m, deps in graph.items() if stage_of(m) == "pdm_lab.envs" and m != "pdm_lab.envs"
            for d in deps if stage_of(d) == "pdm_lab.envs" and d != "pdm_lab.envs" and envs_layer(d) > envs_layer(m)]


def test_envs_packages_import_only_downward():
    assert envs_layer("pdm_lab.envs.problems.bandit") < envs_layer("pdm_lab.envs.audit.study") < envs_layer("pdm_lab.envs.presets")
    assert not upward_envs_imports(GRAPH), upward_envs_imports(GRAPH)


def test_planted_upward_import_is_caught():
    planted = {**GRAPH, "pdm_lab.envs.audit.coupled": GRAPH["pdm_lab.envs.audit.coupled"] | {"pdm_lab.envs.presets"}}
    assert upward_envs_imports(planted) == ["pdm_lab.envs.audit.coupled -> pdm_lab.envs.presets"]
