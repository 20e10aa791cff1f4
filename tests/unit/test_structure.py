"""Size promises the code keeps: no class holds more than MAX_ATTRIBUTES instance attributes (what a reader must keep
in mind to follow one), the learner and the controller fewer, as the parts they were split into allow. Counted from
the source: every `self.x = ...` in a class's methods, and a dataclass's fields. Pydantic sections are left out:
their fields are the job file's contract (docs/grpo.md names them), not state."""

import ast
from pathlib import Path

import pytest

from tests.helpers import ROOT

FOLDERS = ("tandem", "services", "learner", "rollout", "kernels")
MAX_ATTRIBUTES = 18
SMALLER = {"Learner": 15, "Controller": 15}
MAX_LINES = {"Controller": 400}  # the cycle read top to bottom (docs/grpo.md §3), its parts in modules of their own
MAX_FUNCTION_LINES = 50  # a function a reader follows in one screen


def class_attributes(tree: ast.Module) -> dict[str, set[str]]:
    """{class name: its instance attributes} of the classes in a module (pydantic models left out)."""
    out = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
        if bases & {"BaseModel", "_Section"}:
            continue
        attrs = set()
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and "ClassVar" not in ast.unparse(
                    item.annotation):
                attrs.add(item.target.id)
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(item):
                    targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(
                        sub, (ast.AnnAssign, ast.AugAssign)) else []
                    for t in targets:
                        for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                            if isinstance(el, ast.Attribute) and getattr(el.value, "id", None) == "self":
                                attrs.add(el.attr)
        out[node.name] = attrs
    return out


def oversized(root: Path) -> list[str]:
    out = []
    for folder in FOLDERS:
        for f in sorted((root / folder).rglob("*.py")):
            for name, attrs in class_attributes(ast.parse(f.read_text())).items():
                limit = SMALLER.get(name, MAX_ATTRIBUTES)
                if len(attrs) > limit:
                    out.append(f"{f.relative_to(root)}: {name} holds {len(attrs)} attributes (at most {limit}): "
                               f"{sorted(attrs)}")
    return out


def test_no_class_holds_more_than_its_share_of_attributes():
    assert oversized(ROOT) == []


@pytest.mark.parametrize("source,expect", [
    ("class Learner:\n    def __init__(self):\n" + "".join(f"        self.a{i} = {i}\n" for i in range(16)),
     "Learner holds 16 attributes (at most 15)"),
    ("from dataclasses import dataclass\n@dataclass\nclass Wide:\n" + "".join(f"    f{i}: int\n" for i in range(19)),
     "Wide holds 19 attributes (at most 18)"),
    ("class Grows:\n    def setup(self):\n        " + ", ".join(f"self.b{i}" for i in range(19)) + " = range(19)\n",
     "Grows holds 19 attributes (at most 18)"),
])
def test_a_class_past_its_share_is_named(tmp_path, source, expect):
    """The count is not vacuous: attributes set in any method, tuple assignments and dataclass fields count."""
    (tmp_path / "learner").mkdir()
    (tmp_path / "learner" / "big.py").write_text(source)
    found = oversized(tmp_path)
    assert len(found) == 1 and expect in found[0], found


def overlong(root: Path, kinds: tuple, limit) -> list[str]:
    """The definitions of `kinds` (ast node types) longer than limit(name) lines (None: no limit for that name)."""
    out = []
    for folder in FOLDERS:
        for f in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, kinds) and (most := limit(node.name)) is not None and \
                        (n := node.end_lineno - node.lineno + 1) > most:
                    out.append(f"{f.relative_to(root)}: {node.name} spans {n} lines (at most {most})")
    return out


def overlong_classes(root: Path) -> list[str]:
    return overlong(root, (ast.ClassDef,), MAX_LINES.get)


def test_the_controller_stays_short(tmp_path):
    assert overlong_classes(ROOT) == []
    (tmp_path / "services").mkdir()
    (tmp_path / "services" / "c.py").write_text("class Controller:\n" + "    x = 1\n" * 400)
    assert overlong_classes(tmp_path) == ["services/" "c.py: Controller spans 401 lines (at most 400)"]


def overlong_functions(root: Path) -> list[str]:
    return overlong(root, (ast.FunctionDef, ast.AsyncFunctionDef), lambda _name: MAX_FUNCTION_LINES)


def test_no_function_is_longer_than_a_screen(tmp_path):
    assert overlong_functions(ROOT) == []
    (tmp_path / "rollout").mkdir()
    (tmp_path / "rollout" / "f.py").write_text("def f():\n" + "    x = 1\n" * 50)
    assert overlong_functions(tmp_path) == ["rollout/" "f.py: f spans 51 lines (at most 50)"]
