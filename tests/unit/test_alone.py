"""`make test` runs the unit and the integration tests two files at a time; a test that reads what every process on
the machine leaves (/dev/shm, every process's CPU time) or takes the `ray start` head (its wall-time bounds) runs by
itself: it is marked `alone`, and the Makefile's parallel calls leave those out."""

import ast
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

MACHINE_WIDE = {"shm_entries", "unmapped_semaphores", "host_state"}  # what they read is every process's


def must_run_alone(source: str) -> set[str]:
    """The test functions of a module's source that read machine-wide state or take the ray_head fixture."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            names = {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
                     if isinstance(n, (ast.Name, ast.Attribute))}
            if names & MACHINE_WIDE or "ray_head" in {a.arg for a in node.args.args}:
                found.add(node.name)
    return found


def marked_alone(source: str) -> set[str]:
    """The test functions decorated with pytest.mark.alone."""
    return {node.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)
            and any(ast.unparse(d) == "pytest.mark.alone" for d in node.decorator_list)}


@pytest.mark.parametrize("source, expect", [
    ("def test_a(tmp_path):\n    before = shm_entries()\n", {"test_a"}),
    ("def test_b(ray_head, tmp_path):\n    pass\n", {"test_b"}),
    ("def test_c(ray_session):\n    x = unmapped_semaphores\n", {"test_c"}),
    ("def test_d(ray_session):\n    pass\ndef helper():\n    shm_entries()\n", set()),
    ("def test_e(machine):\n    state = machine.host_state(sample_s=0.5)\n", {"test_e"}),
])
def test_what_must_run_alone_is_found(source, expect):
    assert must_run_alone(source) == expect


def test_every_test_that_must_run_alone_is_collected_as_such():
    texts = {f.relative_to(ROOT).as_posix(): f.read_text() for f in sorted((ROOT / "tests").glob("*/test_*.py"))}
    need = {(f, t) for f, text in texts.items() for t in must_run_alone(text)}
    marked = {(f, t) for f, text in texts.items() for t in marked_alone(text)}
    # the files that may hold one (a mark in their text, or one conftest gives: the ray_head tests, in `need`)
    maybe = sorted({f for f, _ in need} | {f for f, text in texts.items() if "mark.alone" in text})
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "alone", *maybe],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    collected = {(ln.split("::")[0], ln.split("::")[1].split("[")[0])
                 for ln in p.stdout.splitlines() if "::" in ln}
    assert need and need <= collected, sorted(need - collected)  # the ray_head ones by conftest, the rest by decorator
    assert collected == need | marked, sorted(collected ^ (need | marked))


def test_the_makefile_runs_the_alone_tests_by_themselves():
    recipe = re.search(r"^test: install\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)[1]
    calls = [ln.strip() for ln in recipe.splitlines()]
    parallel = [c.split() for c in calls if "-n 2" in c and '-m "not alone"' in c]  # one call or one each
    for tests in ("tests/unit", "tests/integration"):
        assert any(tests in c for c in parallel), calls
    assert any("-m alone" in c and "-n " not in c and c.endswith("tests/unit tests/integration") for c in calls), calls
