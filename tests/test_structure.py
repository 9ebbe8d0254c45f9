"""The layout's promises (docs/architecture.md), checked on the source."""

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "megatron_cegrpo"


def _nodes():
    for f in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f.relative_to(PKG.parent), node


@pytest.mark.parametrize("kind, limit", [(ast.ClassDef, 300), ((ast.FunctionDef, ast.AsyncFunctionDef), 80)],
                         ids=["classes<=300", "functions<=80"])
def test_no_long_classes_or_functions(kind, limit):
    long = [f"{f}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)" for f, n in _nodes()
            if isinstance(n, kind) and n.end_lineno - n.lineno + 1 > limit]
    assert long == []


def test_the_loop_knows_no_anchor():
    """The trainer, driver, stage worker, reducer and checkpointer never name the anchor's code:
    the anchor reaches them only through the circuit slot (training/circuit.py)."""
    files = sorted((PKG / "training").glob("*.py"))
    assert {"trainer.py", "driver.py", "stage.py", "circuit.py"} <= {f.name for f in files}
    for f in files:
        if f.name == "circuit.py":
            continue
        tree = ast.parse(f.read_text())
        imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in imported if m and m.startswith("megatron_cegrpo.anchor")], f
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
            n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not [n for n in names if "anchor" in n.lower()], (f, sorted(n for n in names if "anchor" in n.lower()))


def test_no_environment_variable_is_read_as_a_test_seam():
    offenders = [str(f) for f in PKG.rglob("*.py") if "CEGRPO_ANCHOR_DUMP_DIR" in f.read_text()]
    assert offenders == []
