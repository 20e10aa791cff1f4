"""The repository speaks of the project, in words a reader can follow: no numbered item of the work's history (an
issue, a session or a task by its number) in any tracked file (a result is labelled by its date, machine and commit),
and every path of this repository that a file cites exists (a link check)."""

import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ROOT

HISTORY = re.compile(r"\b(issue|session|task|stop)s?[\s#-]*\d+", re.IGNORECASE)
TOP = ("bench", "deploy", "docs", "examples", "kernels", "learner", "rollout", "services", "tandem", "tests")
# a file, by its extension (a metric such as learner/mfu or a prefix such as rollout/0/ is not one)
CITED = re.compile(r"(?<![\w/.-])((?:%s)/[\w./-]*?\.(?:py|md|json|jsonl|sh|yaml|yml|txt|png|toml)\b)"
                   % "|".join(TOP))
TEXT = (".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".json", ".cfg")


def tracked() -> list:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / n for n in names if n.endswith(TEXT) or n in ("Makefile",)]


def history_refs(text: str) -> list[str]:
    return [m[0] for m in HISTORY.finditer(text)]


def missing_citations(text: str) -> list[str]:
    """Paths of this repository the text names that do not exist (globs, placeholders and run outputs left out)."""
    out = []
    for m in CITED.finditer(text):
        path = m[1]
        if text[max(m.start() - 3, 0):m.start()] == '/ "':  # a path joined at runtime (tmp_path / "learner/x.py")
            continue
        if any(c in path for c in "*{<") or path.startswith(("tests/tmp", "tandem/services", "tandem/learner",
                                                             "tandem/rollout", "tandem/kernels")):
            continue  # a pattern, or the import name of a top-level folder (tandem.* remapped)
        if not (ROOT / path).exists():
            out.append(path)
    return out


def test_no_file_cites_a_numbered_item_of_the_works_history():
    found = {str(f.relative_to(ROOT)): refs for f in tracked() if f.is_file() and f.resolve() != Path(__file__).resolve()
             and (refs := history_refs(f.read_text(errors="replace")))}  # this file's examples are the check's own
    assert found == {}


def test_every_path_a_file_cites_exists():
    found = {str(f.relative_to(ROOT)): bad for f in tracked() if f.is_file() and not f.name.endswith(".json")
             and f.resolve() != Path(__file__).resolve() and (bad := missing_citations(f.read_text(errors="replace")))}
    assert found == {}


@pytest.mark.parametrize("text,history,missing", [
    # the examples are split in the source so that a grep of the repository does not take them for citations
    ("measured in sess" "ion 24 (bench/results/e2e_gpu_scale.md)", ["sess" "ion 24"], []),
    ("iss" "ue #30's target; see learner/no_such_module.py.", ["iss" "ue #30"], ["learner/no_such_module.py"]),
    ("Tas" "ks 3 and\nsession\n12", ["Tas" "ks 3", "session\n12"], []),
    ("the 2026-12-03 run (bafd0fc), docs/grpo.md", [], []),
])
def test_the_checks_find_what_they_name(text, history, missing):
    assert history_refs(text) == history and missing_citations(text) == missing


def our_classes() -> dict[str, set[str]]:
    """{class name: its methods and attributes} of every class in the packages (read from the source)."""
    import ast

    out: dict[str, set[str]] = {}
    for folder in ("tandem", "services", "learner", "rollout", "kernels"):
        for f in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.ClassDef):
                    names = out.setdefault(node.name, set())
                    for sub in ast.walk(node):
                        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            names.add(sub.name)
                        elif isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
                            names.add(sub.target.id)
                        elif isinstance(sub, ast.Attribute) and getattr(sub.value, "id", None) == "self":
                            names.add(sub.attr)
    return out


def unknown_identifiers(text: str, classes: dict[str, set[str]]) -> list[str]:
    """Code names in backticks that say they are ours and are not: `Class.member` of one of our classes, and
    `kernels.module.Name` (or tandem.*) that does not import."""
    import importlib

    out = []
    for cls, member in re.findall(r"`([A-Z]\w+)\.(\w+)`", text):
        if cls in classes and member not in classes[cls]:
            out.append(f"{cls}.{member}")
    for dotted in re.findall(r"`((?:tandem\.)?(?:core|kernels|learner|rollout|services)\.[\w.]+)`", text):
        name = dotted if dotted.startswith("tandem.") else f"tandem.{dotted}"
        module, _, attr = name.rpartition(".")
        try:
            found = hasattr(importlib.import_module(module), attr)
        except ImportError:
            found = False
        if not found:
            try:
                importlib.import_module(name)
            except ImportError:
                out.append(dotted)
    return out


def test_the_code_names_the_readme_and_docs_give_exist():
    classes = our_classes()
    found = {str(f.relative_to(ROOT)): bad for f in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
             if (bad := unknown_identifiers(f.read_text(), classes))}
    assert found == {}
    assert unknown_identifiers("`Learner.needs_old`, `Learner.needs_new`, `kernels.logprobs.NoSuch`", classes) == [
        "Learner.needs_new", "kernels.logprobs.NoSuch"]
