"""One start-up for every entry point (megatron_cegrpo/bootstrap.py): each entry point calls
``bootstrap`` first, no file edits ``sys.path``, warning filters live in one place, and
``megatron_cegrpo/train.py`` can run as a script (what the launchers do) without shadowing."""

import ast
import importlib.machinery
import os
import re
import subprocess
import sys
import warnings

import pytest

from megatron_cegrpo.bootstrap import KNOWN_WARNINGS, bootstrap, quiet_known_warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCANNED = ("megatron_cegrpo", "tools", "benchmarks", "examples")
#: every script the docs tell users (or launchers) to run; discovered entry points must be listed
ENTRY_POINTS = {
    "megatron_cegrpo/train.py", "tools/evaluate.py", "tools/plot_runs.py", "tools/checkpoint/convert.py",
    "tools/codec_fidelity.py", "tools/codec_emulation.py", "tools/codec_error.py", "tools/codec_frontier.py",
    "tools/study_report.py", "tools/study_baseline.py", "tools/build_ops.py", "tools/forecast_report.py",
    "benchmarks/bench_codec.py", "benchmarks/bench_basis.py", "benchmarks/bench_link.py", "benchmarks/_link_worker.py",
    "benchmarks/projection.py", "benchmarks/bench_peer.py", "benchmarks/_peer_trl_worker.py",
    "benchmarks/bench_threads.py", "benchmarks/bench_iteration.py", "benchmarks/bench_rollout.py",
    "benchmarks/bench_gpu.py", "benchmarks/bench_gen_rounds.py",
    "megatron_cegrpo/compat/precision.py",
}
#: top-level modules that emit the known warnings while they are imported
WARN_AT_IMPORT = ("megatron.core", "benchmarks.link_model", "megatron_cegrpo.pipeline")


def _py_files():
    for top in SCANNED:
        for root, _dirs, files in os.walk(os.path.join(REPO, top)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(root, f)
                    yield os.path.relpath(path, REPO), open(path, encoding="utf-8").read()


def _main_guard(tree) -> bool:
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) and "__name__" in ast.unparse(node.test):
            return True
    return False


def test_entry_points_are_the_listed_ones():
    found = {rel for rel, src in _py_files() if _main_guard(ast.parse(src))}
    assert found == ENTRY_POINTS, "a new entry point? add it to ENTRY_POINTS (it must call bootstrap first)"


@pytest.mark.parametrize("rel", sorted(ENTRY_POINTS))
def test_entry_point_calls_bootstrap_first(rel):
    tree = ast.parse(open(os.path.join(REPO, rel), encoding="utf-8").read())
    top_imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert any(isinstance(n, ast.ImportFrom) and n.module == "megatron_cegrpo.bootstrap"
               and [a.name for a in n.names] == ["bootstrap"] for n in top_imports), rel
    for n in top_imports:  # megatron-core warns at import: only after bootstrap(), inside main
        mods = [n.module or ""] if isinstance(n, ast.ImportFrom) else [a.name for a in n.names]
        assert not any(m.startswith(WARN_AT_IMPORT) for m in mods), f"{rel}: {ast.unparse(n)} at module top"
    mains = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    assert len(mains) == 1, f"{rel}: no main()"
    body = [st for st in mains[0].body  # without the docstring
            if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
    calls = [i for i, st in enumerate(body) if "bootstrap(" in ast.unparse(st)]
    assert calls, f"{rel}: main() does not call bootstrap()"
    for st in body[:calls[0]]:  # before it: at most the flag parsing / the supervisor hand-off
        assert not isinstance(st, (ast.Import, ast.ImportFrom)), f"{rel}: imports before bootstrap()"
        text = ast.unparse(st)
        assert re.search(r"ArgumentParser|add_argument|build_parser|parse_args|supervise", text), \
            f"{rel}: {text!r} before bootstrap()"


def test_no_file_edits_sys_path():
    edit = re.compile(r"sys\.path\s*(\.\s*(insert|append|extend|remove|pop|clear)\b|\[[^\]]*\]\s*=(?!=)|\+=|=(?!=))"
                      r"|site\.addsitedir")
    bad = [f"{rel}:{i}: {line.strip()}" for rel, src in _py_files()
           for i, line in enumerate(src.splitlines(), 1) if edit.search(line)]
    assert not bad, "sys.path edited (the package is installed; benchmarks run as python -m):\n" + "\n".join(bad)


def test_warning_filters_only_in_bootstrap():
    bad = [f"{rel}:{i}" for rel, src in _py_files() if rel != os.path.join("megatron_cegrpo", "bootstrap.py")
           for i, line in enumerate(src.splitlines(), 1) if re.search(r"\b(filterwarnings|simplefilter)\(", line)]
    assert not bad, "warning filters belong in megatron_cegrpo/bootstrap.py KNOWN_WARNINGS: " + ", ".join(bad)


def test_package_modules_shadow_nothing():
    """``python megatron_cegrpo/train.py`` puts megatron_cegrpo/ first on sys.path, so none of
    its module names may be a standard-library or installed top-level module."""
    pkg = os.path.join(REPO, "megatron_cegrpo")
    names = sorted({n[:-3] if n.endswith(".py") else n for n in os.listdir(pkg)
                    if not n.startswith(("_", ".")) and (n.endswith(".py") or os.path.isdir(os.path.join(pkg, n)))})
    assert "train" in names and "models" in names
    repo = os.path.realpath(REPO)
    path = [p for p in sys.path  # what a script run finds besides megatron_cegrpo/ (not this checkout's folders)
            if not (os.path.realpath(p or ".") + os.sep).startswith(repo + os.sep)]
    clashes = [n for n in names if n in sys.stdlib_module_names or importlib.machinery.PathFinder.find_spec(n, path)]
    assert not clashes, f"megatron_cegrpo/ modules that would shadow a top-level module: {clashes}"


def test_bootstrap_filters_threads_and_idempotence():
    import torch

    before = torch.get_num_threads()
    with warnings.catch_warnings():
        warnings.resetwarnings()
        bootstrap(num_threads=1)
        bootstrap(num_threads=1)
        mine = [f for f in warnings.filters if f[0] == "ignore" and f[1] is not None]
        assert len(mine) == len(KNOWN_WARNINGS)  # once each, however often it is called
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            quiet_known_warnings()
            for message, category, why in KNOWN_WARNINGS:
                assert why
                warnings.warn(message.replace("\\", "") + ". Falling back.", category)
            warnings.warn("another warning", UserWarning)
        assert [str(w.message) for w in got] == ["another warning"]
    assert torch.get_num_threads() == 1
    torch.set_num_threads(before)


def test_bootstrap_quiets_megatron_import_and_applies_compat_on_request():
    code = ("from megatron_cegrpo.bootstrap import bootstrap\n"
            "bootstrap(num_threads=1, cpu_compat=True)\n"
            "import megatron.core.optimizer, torch\n"
            "from megatron_cegrpo.compat import is_active\n"
            "assert torch.get_num_threads() == 1 and is_active() == (not torch.cuda.is_available())\n"
            "print('ok')\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-W", "always::UserWarning", "-c", code], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]
    assert "Transformer Engine and Apex" not in p.stderr, p.stderr[-3000:]


def test_train_runs_as_a_script():
    """The launchers' way (``deepspeed ... megatron_cegrpo/train.py``): a plain script run."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, os.path.join("megatron_cegrpo", "train.py"), "--help"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert p.returncode == 0 and "--pipeline-model-parallel-size" in p.stdout, p.stderr[-3000:]
