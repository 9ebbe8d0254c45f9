"""megatron_cegrpo/checkpointing/: one concern per module, importable without a process group.

* every module imports with ``torch.distributed`` not initialised (and does not initialise it);
* ``atomic.py`` is standard library only: loaded on its own it pulls in neither torch
  (so not ``torch.distributed``) nor the format module, and its source imports neither;
* the package re-exports the public names callers use as ``ck.X``;
* no function of the package is longer than 80 lines.
"""

import ast
import os
import subprocess
import sys

import pytest

from megatron_cegrpo import checkpointing as ck

PKG = os.path.dirname(ck.__file__)
REPO = os.path.dirname(os.path.dirname(PKG))
MODULES = ["atomic", "format", "stage_files", "commit", "compat", "collectives"]


def _run(code):
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_modules_import_without_process_group():
    out = _run(
        "import importlib, torch.distributed as dist\n"
        f"for m in {MODULES!r}:\n"
        "    importlib.import_module('megatron_cegrpo.checkpointing.' + m)\n"
        "    assert not dist.is_initialized(), m\n"
        "print('ok')\n"
    )
    assert out.strip() == "ok"


def test_atomic_is_standalone():
    # load atomic.py by path, without the package __init__ (which imports the other modules)
    out = _run(
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('ck_atomic_alone', {os.path.join(PKG, 'atomic.py')!r})\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron_cegrpo'))\n"
        "print(bad)\n"
    )
    assert out.strip() == "[]"


def test_atomic_source_imports_stdlib_only():
    tree = ast.parse(open(os.path.join(PKG, "atomic.py")).read())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append("." * node.level + (node.module or ""))
    for name in names:
        assert not name.startswith((".", "torch", "megatron_cegrpo")), f"atomic.py imports {name}"
        assert "format" not in name and "distributed" not in name, f"atomic.py imports {name}"


@pytest.mark.parametrize("name", [
    "ANCHOR", "ANCHOR_DIR", "CheckpointError", "FORMAT_VERSION", "MODEL_FILE", "TOKENIZER_DIR",
    "agree_on_errors", "begin_save", "check_compatible", "check_resume", "check_save_dir", "commit_save",
    "find_resume_checkpoint", "has_checkpoint", "hf_config_from_meta", "is_save_iteration", "iter_dir_name",
    "list_checkpoints", "load_stage_model", "make_meta", "read_meta", "read_stage_blob", "read_stage_file",
    "resolve_load_dir", "sha256_file", "stage_file_names", "stage_model_state_dict", "verify_checkpoint",
    "write_stage_blob", "write_stage_file",
])
def test_public_names_reexported(name):
    assert hasattr(ck, name)
    assert name in ck.__all__


def test_save_cadence_defined_once():
    from megatron_cegrpo.checkpointing import collectives

    assert ck.is_save_iteration is collectives.is_save_iteration
    defs = [m for m in MODULES
            if "def is_save_iteration" in open(os.path.join(PKG, m + ".py")).read()]
    assert defs == ["collectives"]


def test_functions_are_short():
    long = []
    for m in MODULES + ["__init__"]:
        path = os.path.join(PKG, m + ".py")
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long.append(f"{m}.{node.name}: {n} lines")
    assert not long, long
