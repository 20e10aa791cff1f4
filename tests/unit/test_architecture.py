"""The package layout holds by construction: imports go one way (README: Architecture), core stays light."""

import ast
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT


# package -> the tandem packages it may import (itself included), as docs/architecture.md draws them
def drawn_imports(root: Path) -> dict[str, set[str]]:
    """docs/architecture.md's `imports` block: `unit -> unit, unit` per line (units: core, kernels, learner,
    rollout, services/<part>)."""
    text = (root / "docs" / "architecture.md").read_text()
    block = text.split("```imports\n", 1)[1].split("```", 1)[0]
    out = {}
    for line in block.splitlines():
        unit, _, targets = line.partition("->")
        out[unit.strip()] = {t.strip() for t in targets.split(",") if t.strip()}
    return out


def unit_of(path: Path, root: Path) -> str:
    parts = path.relative_to(root).parts
    return "core" if parts[0] == "tandem" else f"services/{parts[1]}" if parts[0] == "services" else parts[0]


def target_unit(module: str) -> str | None:
    p = module.split(".")
    if p[0] != "tandem" or len(p) < 2:
        return None
    return f"services/{p[2]}" if p[1] == "services" and len(p) > 2 else p[1]


def actual_imports(root: Path) -> dict[str, dict[str, str]]:
    """unit -> {unit it imports: the first file:line that does}, imports inside functions included."""
    out: dict[str, dict[str, str]] = {}
    for folder in ("tandem/core", "kernels", "learner", "rollout", "services"):
        for f in sorted((root / folder).rglob("*.py")):
            u = unit_of(f, root)
            out.setdefault(u, {})
            for node in ast.walk(ast.parse(f.read_text(), str(f))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
                for t in filter(None, map(target_unit, names)):
                    if t != u:
                        out[u].setdefault(t, f"{f.relative_to(root)}:{node.lineno}")
    return out


def picture_mismatches(root: Path) -> list[str]:
    drawn, have = drawn_imports(root), actual_imports(root)
    out = [f"{where}: {u} imports {t}, which docs/architecture.md does not draw"
           for u, ts in have.items() for t, where in ts.items() if t not in drawn.get(u, set())]
    out += [f"docs/architecture.md draws {u} -> {t}, which no file of {u} imports"
            for u, ts in drawn.items() for t in ts if t not in have.get(u, {})]
    return out


def cycle(edges: dict[str, set[str]]) -> list[str]:
    """A cycle among the units, or []."""
    state: dict[str, int] = {}

    def visit(u, path):
        state[u] = 1
        for t in sorted(edges.get(u, ())):
            if state.get(t) == 1:
                return path[path.index(t):] + [t] if t in path else [u, t]
            if not state.get(t) and (found := visit(t, path + [t])):
                return found
        state[u] = 2
        return []
    return next((c for u in sorted(edges) if not state.get(u) and (c := visit(u, [u]))), [])


def test_the_architecture_picture_is_the_imports_as_they_are():
    assert picture_mismatches(ROOT) == []
    assert cycle(drawn_imports(ROOT)) == []


def test_an_import_the_picture_lacks_or_a_cycle_is_named(tmp_path):
    for f in ("tandem/core", "kernels", "learner", "rollout", "services/app", "services/orchestrator",
              "services/devtools", "docs"):
        (tmp_path / f).mkdir(parents=True)
    (tmp_path / "docs/architecture.md").write_text("```imports\nlearner -> core\nrollout -> learner\n"
                                                   "services/app -> rollout\n```\n")
    (tmp_path / "learner/a.py").write_text("from tandem.core.config import JobConfig\nimport tandem.rollout.x\n")
    (tmp_path / "services/app/b.py").write_text("def f():\n    from tandem.services.devtools import demo\n")
    found = picture_mismatches(tmp_path)
    assert "learner/" "a.py:2: learner imports rollout, which docs/architecture.md does not draw" in found
    assert any("services/app imports services/devtools" in x for x in found)  # inside a function too
    assert "docs/architecture.md draws rollout -> learner, which no file of rollout imports" in found
    assert "docs/architecture.md draws services/app -> rollout, which no file of services/app imports" in found
    assert cycle({"learner": {"rollout"}, "rollout": {"learner"}}) == ["learner", "rollout", "learner"]
    assert cycle({"a": {"b"}, "b": {"c"}}) == []


# The rules the picture keeps whatever is added to it: rollout and learner never import each other or services,
# kernels import nothing of Tandem, the orchestrator (one job's Controller actor) never the app or the dev tools.
NEVER = {"rollout": {"learner", "kernels", "services/app", "services/orchestrator", "services/devtools"},
         "learner": {"rollout", "services/app", "services/orchestrator", "services/devtools"},
         "kernels": {"core", "learner", "rollout", "services/app", "services/orchestrator", "services/devtools"},
         "core": {"kernels", "learner", "rollout", "services/app", "services/orchestrator", "services/devtools"},
         "services/orchestrator": {"services/app", "services/devtools"}}


def test_the_picture_keeps_the_direction():
    drawn = drawn_imports(ROOT)
    assert {u: drawn.get(u, set()) & bad for u, bad in NEVER.items() if drawn.get(u, set()) & bad} == {}
    assert not [f for f in (ROOT / "services").glob("*.py") if f.name != "__init__.py"], "a module outside the three"


# what tandem.core may import at all: the standard library and these (no torch, vLLM, Ray, ...)
CORE_THIRD_PARTY = {"pydantic", "yaml", "numpy"}


def heavy_core_imports(root: Path) -> list[str]:
    """tandem.core's module-level imports of anything but the standard library and CORE_THIRD_PARTY (a heavy
    library imported inside a function is paid for only when it is called)."""
    out = []
    for f in sorted((root / "tandem/core").rglob("*.py")):
        for node in ast.parse(f.read_text(), str(f)).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
            for mod in (n.split(".")[0] for n in names):
                if mod not in CORE_THIRD_PARTY | {"tandem", "__future__"} and mod not in sys.stdlib_module_names:
                    out.append(f"{f.relative_to(root)}:{node.lineno} tandem.core imports {mod} (allowed: the standard "
                               f"library, {sorted(CORE_THIRD_PARTY)}; heavy imports belong inside functions of compat)")
    return out


def test_core_imports_only_light_libraries_at_module_level():
    assert heavy_core_imports(ROOT) == []


def test_core_heavy_import_is_caught(tmp_path):
    (tmp_path / "tandem/core").mkdir(parents=True)
    (tmp_path / "tandem/core/x.py").write_text("import torch\n")
    for f in ("kernels", "learner", "rollout", "services"):
        (tmp_path / f).mkdir()
    assert any("tandem.core imports torch" in v for v in heavy_core_imports(tmp_path))


def test_core_imports_nothing_heavy():
    """Validating a job (what `tandem plan` and `tandem submit` do on a laptop) loads no ML library."""
    code = ("import sys, tandem.core.config, tandem.core.plan, tandem.core.protocol, tandem.core.trl, "
            "tandem.core.checks, tandem.core.compat, tandem.services.app.cli; "
            "print(sorted(m for m in ('torch', 'vllm', 'ray', 'deepspeed', 'transformers', 'triton') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
