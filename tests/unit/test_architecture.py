"""The package layout holds by construction: imports go one way (README: Architecture), core stays light."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

# package -> the tandem packages it may import (itself included). core <- everything;
# kernels <- learner <- services -> rollout; rollout and learner never import each other or services.
ALLOWED = {
    "core": {"core"},
    "kernels": {"core", "kernels"},
    "learner": {"core", "kernels", "learner"},
    "rollout": {"core", "rollout"},
    "services": {"core", "kernels", "learner", "rollout", "services"},
}
FOLDERS = {"core": "tandem/core", "kernels": "kernels", "learner": "learner", "rollout": "rollout",
           "services": "services"}
# what tandem.core may import at all: the standard library and these (no torch, vLLM, Ray, ...)
CORE_THIRD_PARTY = {"pydantic", "yaml", "numpy"}


def tandem_imports(path: Path):
    """(line, tandem package) of every import in a file, the ones inside functions included; and
    (line, "external:<module>") of the module-level imports of other packages (a heavy library imported
    inside a function is paid for only when it is called)."""
    tree = ast.parse(path.read_text(), str(path))
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "tandem" and len(parts) > 1:
                yield node.lineno, parts[1]
            elif parts[0] != "tandem" and id(node) in top:
                yield node.lineno, "external:" + parts[0]


def violations(root: Path) -> list[str]:
    out = []
    for pkg, folder in FOLDERS.items():
        for f in sorted((root / folder).rglob("*.py")):
            for line, target in tandem_imports(f):
                rel = f"{f.relative_to(root)}:{line}"
                if target.startswith("external:"):
                    mod = target.split(":", 1)[1]
                    if pkg == "core" and mod not in CORE_THIRD_PARTY and mod not in sys.stdlib_module_names \
                            and mod != "__future__":
                        out.append(f"{rel} tandem.core imports {mod} (allowed: the standard library, "
                                   f"{sorted(CORE_THIRD_PARTY)}; heavy imports belong inside functions of compat)")
                elif target not in ALLOWED[pkg]:
                    out.append(f"{rel} {pkg} imports tandem.{target} (allowed: {sorted(ALLOWED[pkg])})")
    return out


def test_imports_follow_the_direction():
    assert violations(ROOT) == []


@pytest.mark.parametrize("folder,line,expect", [
    ("rollout", "from tandem.learner.grpo import per_token_loss", "rollout imports tandem.learner"),
    ("learner", "import tandem.services.app.run", "learner imports tandem.services"),
    ("tandem/core", "from tandem.rollout.prompts import is_chat", "core imports tandem.rollout"),
    ("kernels", "    from tandem.learner.model import load_policy", "kernels imports tandem.learner"),
])
def test_an_import_against_the_direction_fails(tmp_path, folder, line, expect):
    """The check is not vacuous: a copy of the tree with one import added against the direction fails,
    a lazy import inside a function included."""
    for f in FOLDERS.values():
        dst = tmp_path / f
        dst.mkdir(parents=True)
        for src in (ROOT / f).glob("*.py"):
            (dst / src.name).write_text(src.read_text())
    body = f"def f():\n{line}\n" if line.startswith(" ") else line + "\n"
    (tmp_path / folder / "added.py").write_text(body)
    found = violations(tmp_path)
    assert len(found) == 1 and expect in found[0], found


def test_core_heavy_import_is_caught(tmp_path):
    (tmp_path / "tandem/core").mkdir(parents=True)
    (tmp_path / "tandem/core/x.py").write_text("import torch\n")
    for f in ("kernels", "learner", "rollout", "services"):
        (tmp_path / f).mkdir()
    assert any("tandem.core imports torch" in v for v in violations(tmp_path))


def test_core_imports_nothing_heavy():
    """Validating a job (what `tandem plan` and `tandem submit` do on a laptop) loads no ML library."""
    code = ("import sys, tandem.core.config, tandem.core.plan, tandem.core.protocol, tandem.core.trl, "
            "tandem.core.checks, tandem.core.compat, tandem.services.app.cli; "
            "print(sorted(m for m in ('torch', 'vllm', 'ray', 'deepspeed', 'transformers', 'triton') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# inside services: two programs apart. The app (the `tandem` command and its driver) may import the orchestrator
# (one job's Controller actor and its parts), never the other way; the dev tools (which `tandem tiny-model`
# reaches) may import both, the orchestrator none of them.
SERVICES = {"orchestrator": {"orchestrator"}, "app": {"app", "orchestrator", "devtools"},
            "devtools": {"app", "orchestrator", "devtools"}}


def services_violations(root: Path) -> list[str]:
    out = []
    for part, allowed in SERVICES.items():
        for f in sorted((root / "services" / part).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text(), str(f))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
                for name in names:
                    p = name.split(".")
                    if p[:2] == ["tandem", "services"] and len(p) > 2 and p[2] not in allowed:
                        out.append(f"{f.relative_to(root)}:{node.lineno} services/{part} imports {name} "
                                   f"(allowed: {sorted(allowed)})")
    return out


def test_the_app_may_import_the_orchestrator_never_the_other_way(tmp_path):
    assert services_violations(ROOT) == []
    assert not [f for f in (ROOT / "services").glob("*.py") if f.name != "__init__.py"], "a module outside the three"
    for part in SERVICES:
        (tmp_path / "services" / part).mkdir(parents=True)
    (tmp_path / "services/orchestrator/x.py").write_text("def f():\n    from tandem.services.app.run import run_job\n")
    found = services_violations(tmp_path)
    assert len(found) == 1 and "services/orchestrator imports tandem.services.app.run" in found[0], found
