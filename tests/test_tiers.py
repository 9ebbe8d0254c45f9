"""The suite's tiers (issue 34; ``tests/conftest.py``): every collected test carries exactly one of
``unit``, ``integration``, ``e2e``, and ``module_tier`` reads a module's tier from what it does."""

import json
import os
import subprocess
import sys

import pytest

from conftest import SMOKE_E2E, TIERS, module_tier
from distributed_util import REPO

# its own tier, named (its source quotes a launch only as a sample for module_tier)
pytestmark = pytest.mark.integration


def _write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(body)
    return str(path)


def test_module_tier_reads_what_a_module_does(tmp_path):
    assert module_tier(_write(tmp_path, "test_a.py", "import torch\nX = torch.zeros(3)\n")) == "unit"
    assert module_tier(_write(tmp_path, "test_b.py", "from distributed_util import run_ranks\nrun_ranks([], 2)\n")) \
        == "integration"
    assert module_tier(_write(tmp_path, "test_c.py", "cmd = [launcher(\"deepspeed\"), \"megatron_cegrpo/train.py\"]\n")) \
        == "e2e"
    assert module_tier(_write(tmp_path, "test_e.py", "metrics = launch_train(ARGS, tmp_path)\n")) == "e2e"
    e2e_dir = tmp_path / "e2e"
    e2e_dir.mkdir()
    assert module_tier(_write(e2e_dir, "test_d.py", "def test_x():\n    pass\n")) == "e2e"  # the folder decides


def test_every_collected_test_has_exactly_one_tier(tmp_path):
    """Collect the default suite once, listing each test's tier markers (a plugin passed with -p)."""
    (tmp_path / "tier_probe.py").write_text(
        "import json, os\n"
        "def pytest_collection_finish(session):\n"
        f"    tiers = {TIERS!r}\n"
        "    rows = [[m.name for m in item.iter_markers() if m.name in tiers + ('smoke',)] for item in session.items]\n"
        "    json.dump(rows, open(os.environ['TIER_OUT'], 'w'))\n")
    out = tmp_path / "tiers.json"
    env = dict(os.environ, TIER_OUT=str(out), PYTHONPATH=str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "tier_probe", "tests"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) > 1000
    tiers = [[m for m in r if m != "smoke"] for r in rows]
    assert all(len(r) == 1 for r in tiers), [r for r in tiers if len(r) != 1][:5]
    assert {r[0] for r in tiers} == set(TIERS)
    # `make test` (not e2e, or smoke) and `make test-launch` (e2e, not smoke) split the default suite;
    # every smoke test is an e2e one, so the split leaves none out and runs none twice
    smoke = [r for r in rows if "smoke" in r]
    assert smoke and all(r == ["e2e", "smoke"] or r == ["smoke", "e2e"] for r in smoke)
    assert 0 < sum(r == ["e2e"] for r in rows) < sum("e2e" in r for r in rows)


def test_the_smoke_modules_exist_and_launch():
    """Each module that `make test` runs from the e2e tier (conftest.SMOKE_E2E) is there and is e2e."""
    for rel in SMOKE_E2E:
        path = os.path.join(REPO, "tests", rel)
        assert os.path.isfile(path), rel
        assert module_tier(path) == "e2e", rel
