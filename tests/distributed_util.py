"""Spawn real gloo processes for multi-rank tests."""

import json
import os
import shutil
import socket
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: metrics a resumed run legitimately logs differently from the uninterrupted one at and after the
#: restart: the run's byte totals (they add the restart's start-up messages: the stages' hello to the
#: anchor and its answer) and the share of the driver's own stage whose bf16 value changed since the
#: sampler's last sync (after a restart the last sync is the one that loaded the checkpoint's weights)
#: the whole step's totals (training/ledger.py): a resumed run's carry its restart's start-up bytes
#: (the anchor's hello, the sampler's resync), so resume comparisons leave them out
STEP_TOTALS = ("comm/total_bytes", "comm/total_dense_bytes", "comm/total_ratio", "comm/total_bytes_per_response_token")
RESUME_VOLATILE = ("comm/run_total_bytes", "comm/run_total_dense_bytes", "comm/run_total_ratio",
                   "sync/local_changed_frac")


#: The sampler/trainer log-prob mismatch (nats per token). The sampler generates on all of the
#: host's cores while the trainer ranks run one thread each, and CI's host (not this one: here they
#: are bit-exact, quiet or loaded) has given last-bit different sampler log-probs to runs whose
#: configurations differ only in a probe or in DP, with the same tokens, scores, losses and weights:
#: 3.4e-6 (DP 1 vs 2, fp32 sampler), 6.7e-5 (drift probe), 9.4e-5 (fidelity probe; bf16 sampler
#: weights, mismatch ~0.15). Run-vs-run comparisons (:func:`metric_diffs`) take these keys to
#: ``MISMATCH_ATOL`` nats absolute, ~10x the largest seen; every other metric exactly.
MISMATCH_KEYS = ("mismatch/abs_logprob_diff_mean", "mismatch/logprob_diff_mean")
MISMATCH_ATOL = 1e-3


def metric_diffs(a: Dict, b: Dict) -> Dict[str, tuple]:
    """The keys of two steps' metrics (dicts) whose values differ, as ``{key: (a's, b's)}``: exact
    equality, but :data:`MISMATCH_KEYS` within :data:`MISMATCH_ATOL`. Empty when the steps agree."""
    out = {}
    for k in set(a) | set(b):
        x, y = a.get(k), b.get(k)
        if k in MISMATCH_KEYS and x is not None and y is not None:
            if abs(x - y) > MISMATCH_ATOL:
                out[k] = (x, y)
        elif x != y:
            out[k] = (x, y)
    return out


#: The tiny-model run (tiny-llama) the launch tests and workers start from, as argv: 2 pipeline
#: stages, one optimizer step of 2 prompts x 4 samples in micro-batches of 4, 12 new tokens, AdamW
#: on the CPU, one thread a rank. Tests take it through :func:`tiny_args`, changing what they need.
TINY_RUN: Tuple[str, ...] = (
    "--model", "tiny-llama", "--train-data", "mawps/singleop", "--pipeline-model-parallel-size", "2",
    "--micro-batch-size", "4", "--rollout-batch-size", "2", "--num-generations", "4",
    "--max-new-tokens", "12", "--lr", "1e-4", "--temperature", "1.0", "--kl-coef", "0.01",
    "--deepspeed_config", "ds_configs/cpu_adamw.json", "--no-tqdm", "--num-threads", "1",
)
#: keywords of flags spelled with an underscore (every other keyword's ``_`` is a ``-``)
_UNDERSCORE_FLAGS = ("deepspeed_config",)


def _flag_items(argv) -> List[Tuple[str, List[str]]]:
    """``argv`` as ``[(flag, [values])]`` in order (a flag's values: the words up to the next flag)."""
    items: List[Tuple[str, List[str]]] = []
    for word in argv:
        if word.startswith("--"):
            items.append((word, []))
        else:
            items[-1][1].append(word)
    return items


def tiny_args(**overrides) -> List[str]:
    """:data:`TINY_RUN` with ``overrides``, as a new argv list.

    A keyword is a flag's name with ``_`` for ``-`` (``kl_coef`` is ``--kl-coef``;
    ``deepspeed_config`` is ``--deepspeed_config``, which keeps its underscore). A value gives
    ``--flag value``: a str as it is, an int or float through ``str()`` (so pass ``lr="1e-3"`` to
    keep that spelling), a list or tuple several words (``--flag a b``); ``True`` gives the bare
    flag (``filter_groups=True``); ``None`` or ``False`` drop the flag (``temperature=None``: the
    default). A flag of the base keeps its place with the new value; other flags follow the base
    in the order given. E.g. ``tiny_args(kl_coef=0, anchor_ranks=0, train_iters=3)``."""
    items = _flag_items(TINY_RUN)
    for key, value in overrides.items():
        flag = "--" + (key if key in _UNDERSCORE_FLAGS else key.replace("_", "-"))
        if value is None or value is False:
            words = None
        elif value is True:
            words = []
        elif isinstance(value, (list, tuple)):
            words = [str(v) for v in value]
        elif isinstance(value, (str, int, float)):
            words = [str(value)]
        else:
            raise TypeError(f"tiny_args({key}={value!r}): give a str, int, float, list, tuple, bool or None")
        at = [i for i, (f, _) in enumerate(items) if f == flag]
        if words is None:
            items = [it for it in items if it[0] != flag]
        elif at:
            items[at[0]] = (flag, words)
        else:
            items.append((flag, words))
    return [w for flag, words in items for w in (flag, *words)]


def load_tool(name: str):
    """``tools/<name>.py`` as a module (the tools are scripts, not a package), freshly executed."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{name}_tool", os.path.join(REPO, "tools", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(cmd: List[str], world_size: int, timeout: float = 600, env: Optional[Dict[str, str]] = None):
    """Start ``world_size`` processes of ``cmd`` with RANK/WORLD_SIZE/MASTER_* set; fail on any error."""
    port = free_port()
    procs = []
    for r in range(world_size):
        e = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world_size),
                 LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
        e.update(env or {})
        procs.append(subprocess.Popen([sys.executable] + cmd, env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out)
    except subprocess.TimeoutExpired:
        # keep what every rank printed: a hang under load must leave its tracebacks in the report
        for p in procs:
            if p.poll() is None:
                p.kill()
        tails = [f"--- rank {r} ---\n{(p.communicate()[0] or '')[-3000:]}" for r, p in enumerate(procs)]
        raise AssertionError(f"{world_size} ranks still running after {timeout:.0f} s; killed:\n" + "\n".join(tails))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, out) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            raise AssertionError(f"rank {r} exited {p.returncode}:\n{out[-6000:]}")
    return outs


def run_single(cmd: List[str], timeout: float = 600, env: Optional[Dict[str, str]] = None) -> str:
    e = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    e.update(env or {})
    p = subprocess.run([sys.executable] + cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"exited {p.returncode}:\n{p.stdout[-6000:]}")
    return p.stdout


#: A custom reward (--custom-reward-function FILE:parity_reward) with mixed scores for a random
#: model, whose responses never solve a math problem: groups get non-zero advantages.
PARITY_REWARD = '''
def parity_reward(response, ground_truth):
    return float(len(response) % 2 == 0)
'''


def launch_train(args: List[str], log_dir, ranks: int = 2, timeout: float = 900) -> Dict[int, dict]:
    """``deepspeed --num_gpus ranks megatron_cegrpo/train.py *args --log-dir log_dir`` from the repo
    root, one thread a rank; fail with the output's tail on a non-zero exit. Returns the run's
    ``metrics.jsonl`` as {step: record}."""
    cmd = [launcher("deepspeed"), "--num_gpus", str(ranks), "--master_port", str(free_port()),
           "megatron_cegrpo/train.py", *args, "--log-dir", str(log_dir)]
    p = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-6000:]
    records = (json.loads(x) for x in open(os.path.join(str(log_dir), "metrics.jsonl")) if x.strip())
    return {r["step"]: r for r in records}


def stage_weights(ckpt_dir, pp: int = 2) -> List[dict]:
    """Each stage's ``model.safetensors`` in one checkpoint directory (``iter_NNNNNNN``)."""
    from safetensors.torch import load_file
    return [load_file(os.path.join(str(ckpt_dir), f"stage_{r:02d}", "model.safetensors")) for r in range(pp)]


def plan_of(cfg, world: int, model: str = "tiny-llama"):
    """``cfg`` validated for ``world`` ranks, then its run plan (``plan.resolve_plan``: the layout,
    the codec's capabilities and bytes there, the resume decision) with ``model``'s HF config: what
    ``train.preflight`` resolves, without the data and file checks."""
    from megatron_cegrpo.models import load_hf_config, resolve_model
    from megatron_cegrpo.plan import resolve_plan

    return resolve_plan(cfg.validate(world_size=world), world, load_hf_config(resolve_model(model)))


def launcher(name: str) -> str:
    """Path of the ``deepspeed`` (or other) launcher installed beside this interpreter."""
    exe = shutil.which(name, path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if exe is None:
        raise AssertionError(f"{name} launcher not found next to {sys.executable}; install with `make test`")
    return exe


def complete_metrics(path) -> List[dict]:
    """The complete records of a ``metrics.jsonl`` a run may be writing right now, in file order
    (the piece after the last newline is a record half written); [] while the file is missing."""
    if not os.path.exists(str(path)):
        return []
    lines = open(str(path)).read().split("\n")[:-1]
    return [json.loads(x) for x in lines if x.strip()]


def supervised_worker(launcher_pid: int, rank: int, supervised: bool = True):
    """The supervised worker process (``CEGRPO_SUPERVISED=1``) of ``rank`` among the launcher's
    descendants, as a ``psutil.Process``; ``supervised=False``: the process the launcher started
    for that rank (its supervisor)."""
    import psutil

    for p in psutil.Process(launcher_pid).children(recursive=True):
        try:
            env = p.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if env.get("RANK") == str(rank) and (env.get("CEGRPO_SUPERVISED") == "1") == supervised:
            return p
    raise AssertionError(f"no {'supervised worker' if supervised else 'launched process'} of rank {rank} "
                         f"under pid {launcher_pid}")
