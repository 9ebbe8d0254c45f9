"""Behaviour-preservation runs for refactors (issue "one room per concern").

Two recorded runs whose ``metrics.jsonl`` (timings and wall-clock keys aside) must not change
when the code is restructured:

- ``tiny``: tiny-llama, PP=2, mask codec, anchor c = K = 2, 5 iterations, checkpoint at 3,
  killed there and resumed to 5 (the log then holds iterations 1-5 of the resumed run);
- ``smollm2``: SmolLM2-135M-Instruct, PP=2, mask codec, anchor c = K = 2, 2 iterations
  (about 5 minutes on 2 cores; a script, not part of ``make test``).

Usage::

    python tests/equivalence/equivalence_runs.py record tiny      # writes tests/equivalence/reference/tiny[.<kind>].jsonl
    python tests/equivalence/equivalence_runs.py compare smollm2  # exits 1 and lists the differences

The numbers are bit-exact on one machine and software stack (torch 2.13.0 CPU wheel), but
another CPU rounds float32 reductions differently (on CI's machine the tiny run differed by up
to 1.3e-6 relative where a value is not near 0, and 6e-7 absolute, after 5 steps), so floats
compare within ``REL_TOL``/``ABS_TOL`` and everything else (step, counts, strings) exactly. A behaviour change
(another mask, another loss, a lost update) moves these metrics by orders of magnitude more.
Rounding can also turn a sampled token into another, and then nothing compares: a record keeps
the environment it was made in (``reference/<name>.env.json``, :data:`ENVIRONMENT_KEYS`); a run
may have one record per kind of host (``reference/<name>.<kind>.jsonl``, e.g. ``avx512-amx``:
``record`` on a host that matches none adds one), and the test compares against the record of this
host's kind (where there is none it skips and says what differs).

A record also names the rollout batch's wire format it was made with (``batch_wire`` in its
``.env.json``, ``pipeline.broadcast.BATCH_WIRE``; a record without it predates the name: torch's
own pickle, whose length depended on memory addresses). Against a record of another format,
``comm/batch_bytes`` cannot compare, so every record is compared without it
(:func:`without_batch_bytes`: the ledger's totals less the batch, its ratios left out) and a note
says so; re-recording on that kind of host restores the full comparison.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: distributed_util

from distributed_util import PARITY_REWARD, free_port, launcher  # noqa: E402

from megatron_cegrpo.pipeline.broadcast import BATCH_WIRE  # noqa: E402
from megatron_cegrpo.training.perf import WALL_CLOCK_PREFIXES  # noqa: E402

COMMON = ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "4", "--rollout-batch-size", "2",
          "--num-generations", "4", "--lr", "1e-4", "--temperature", "1.0", "--kl-coef", "0.01",
          "--boundary-codec", "mask", "--anchor-ranks", "1", "--anchor-interval", "2", "--anchor-delay", "2",
          "--deepspeed_config", "ds_configs/cpu_adamw.json", "--no-tqdm", "--num-threads", "1",
          "--train-data", "mawps/singleop"]
RUNS = {
    "tiny": {"args": ["--model", "tiny-llama", "--max-new-tokens", "12", "--save-interval", "3"],
             "iters": 5, "resume_at": 3},
    "smollm2": {"args": ["--model", "smollm2-135m-instruct", "--max-new-tokens", "24"], "iters": 2,
                "resume_at": None},
}
#: keys that measure time, not behaviour
VOLATILE_PREFIXES = WALL_CLOCK_PREFIXES


def _launch(work: str, args, *extra) -> subprocess.CompletedProcess:
    cmd = [launcher("deepspeed"), "--num_gpus", "3", "--master_port", str(free_port()), "megatron_cegrpo/train.py",
           *COMMON, *args, "--custom-reward-function", f"{work}/reward.py:parity_reward", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))  # this checkout's code
    return subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=1800)


def run(name: str, work: str) -> list:
    """Run ``name`` in the scratch directory ``work``; return its metrics records (volatile keys dropped)."""
    spec = RUNS[name]
    with open(os.path.join(work, "reward.py"), "w") as f:
        f.write(PARITY_REWARD)
    log, save = os.path.join(work, "run"), os.path.join(work, "ckpt")
    if spec["resume_at"]:
        first = _launch(work, spec["args"], "--train-iters", str(spec["resume_at"]), "--save", save,
                        "--log-dir", log)
        if first.returncode:
            raise RuntimeError(first.stdout[-4000:])
    p = _launch(work, spec["args"], "--train-iters", str(spec["iters"]), "--save", save, "--load", save,
                "--log-dir", log)
    if p.returncode:
        raise RuntimeError(p.stdout[-4000:])
    with open(os.path.join(log, "metrics.jsonl")) as f:
        recs = [json.loads(x) for x in f if x.strip()]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE_PREFIXES)} for r in recs]


def _record_bases(name: str) -> list:
    """Every record of run ``name`` (paths without ``.jsonl``): ``reference/<name>`` and one per other
    kind of host, ``reference/<name>.<kind>`` (:func:`host_kind`), in that order."""
    ref = os.path.join(HERE, "reference")
    kinds = sorted(f[len(name) + 1:-len(".jsonl")] for f in (os.listdir(ref) if os.path.isdir(ref) else [])
                   if f.startswith(name + ".") and f.endswith(".jsonl"))
    return [os.path.join(ref, name)] + [os.path.join(ref, f"{name}.{k}") for k in kinds]


def _record_base(name: str) -> str:
    """The record of ``name`` made on this kind of host (no :func:`environment_differences`), else the
    first one (``reference/<name>``)."""
    bases = _record_bases(name)
    return next((b for b in bases if os.path.exists(b + ".jsonl") and not _differences_of(b + ".env.json")),
                bases[0])


def host_kind() -> str:
    """This host's record suffix: ATen's CPU capability and whether the CPU has AMX, e.g. ``avx512-amx``."""
    env = environment()
    return env["cpu_capability"].lower() + ("-amx" if env["amx"] else "")


def reference_path(name: str) -> str:
    """The metrics of run ``name`` recorded on this kind of host (``reference/<name>.jsonl`` or
    ``reference/<name>.<kind>.jsonl``), else the first record."""
    return _record_base(name) + ".jsonl"


def environment_path(name: str) -> str:
    """Where the environment of :func:`reference_path`'s record is kept (``.env.json`` beside it)."""
    return _record_base(name) + ".env.json"


#: what the recorded numbers depend on besides the code: sampling turns a float rounded another
#: way into another token, after which every number differs (seen 2026-12-04: the tiny record of
#: an AVX2 host against an AVX-512 one, step 1 already scored 0.625 instead of 0.75; 2026-12-05: an
#: Intel AVX-512 host with AMX against the AMD AVX-512 record, step 1's log-prob mismatch 2e-4 apart,
#: so whether the CPU has AMX, which oneDNN's kernels use, is part of the environment)
ENVIRONMENT_KEYS = ("cpu_capability", "amx", "torch", "transformers", "tokenizers")


@functools.lru_cache(maxsize=None)  # one host per process; every record lookup asks it
def environment() -> dict:
    """This host's :data:`ENVIRONMENT_KEYS` (ATen's CPU capability, e.g. ``AVX512``, and the
    package versions), plus the CPU's name for the reader (not compared)."""
    import importlib.metadata as md

    import torch

    cpu, info = "unknown", {}
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
        info = {k.strip(): v.strip() for k, v in info.items()}
        cpu = f"{info.get('model name', '?')} (family {info.get('cpu family', '?')}, model {info.get('model', '?')})"
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "amx": "amx_bf16" in info.get("flags", "").split(), "torch": torch.__version__,
            "transformers": md.version("transformers"), "tokenizers": md.version("tokenizers"), "cpu": cpu}


def environment_differences(name: str) -> list:
    """How this host differs from the one that recorded ``name`` in :data:`ENVIRONMENT_KEYS`
    (lines such as ``cpu_capability: recorded AVX2, here AVX512``); empty when they agree or the
    record says nothing of its environment."""
    return _differences_of(environment_path(name))


def _recorded_environment(env_path: str) -> Optional[dict]:
    """The environment a record keeps beside it (None when it keeps none)."""
    if not os.path.exists(env_path):
        return None
    with open(env_path) as f:
        return json.load(f)


def _differences_of(env_path: str) -> list:
    rec = _recorded_environment(env_path)
    if rec is None:
        return []
    here = environment()
    return [f"{k}: recorded {rec.get(k)}, here {here[k]}" for k in ENVIRONMENT_KEYS if rec.get(k) != here[k]]


#: float tolerance across CPUs (module docstring); ints and strings compare exactly
REL_TOL, ABS_TOL = 1e-5, 1e-5


def _same(e, g) -> bool:
    if isinstance(e, float) or isinstance(g, float):
        return (isinstance(e, (int, float)) and isinstance(g, (int, float))
                and math.isclose(e, g, rel_tol=REL_TOL, abs_tol=ABS_TOL))
    return e == g


#: the ledger's keys (training/ledger.py) that are quotients of totals including the batch
BATCH_QUOTIENTS = ("comm/total_ratio", "comm/run_total_ratio", "comm/total_bytes_per_response_token")


def without_batch_bytes(recs: list) -> list:
    """``recs`` (a run's metric records, in step order from step 1) with ``comm/batch_bytes`` taken
    out: dropped, subtracted from ``comm/total_bytes`` and ``comm/total_dense_bytes`` (the ledger
    counts it in both), its running sum from ``comm/run_total_bytes`` and
    ``comm/run_total_dense_bytes``, and :data:`BATCH_QUOTIENTS` dropped."""
    out, run = [], 0
    for r in recs:
        r = dict(r)
        b = r.pop("comm/batch_bytes", 0)
        run += b
        for k, minus in (("comm/total_bytes", b), ("comm/total_dense_bytes", b),
                         ("comm/run_total_bytes", run), ("comm/run_total_dense_bytes", run)):
            if k in r:
                r[k] -= minus
        for k in BATCH_QUOTIENTS:
            r.pop(k, None)
        out.append(r)
    return out


def record_batch_wire(name: str) -> str:
    """The batch wire format of :func:`reference_path`'s record (``"torch-pickle"`` when its
    environment does not name one: recorded before 2026-12-06)."""
    return (_recorded_environment(environment_path(name)) or {}).get("batch_wire", "torch-pickle")


def compare_with_record(name: str, got: list, limit: int = None) -> tuple:
    """(differences, notes) of the run ``got`` against the record of ``name`` made on this kind of
    host (its first ``limit`` records when given): :func:`differences`, without the batch's bytes
    (:func:`without_batch_bytes`) when the record was made with another batch wire format, which
    the notes then say."""
    with open(reference_path(name)) as f:
        expected = [json.loads(x) for x in f if x.strip()][:limit]
    notes = []
    wire = record_batch_wire(name)
    if wire != BATCH_WIRE:
        expected, got = without_batch_bytes(expected), without_batch_bytes(got)
        notes.append(f"the {name} record's batch went as {wire}, this code's as {BATCH_WIRE}: compared without "
                     f"comm/batch_bytes (re-record on a {host_kind()} host to compare it too)")
    return differences(expected, got), notes


def differences(expected: list, got: list) -> list:
    """Human-readable differences between two metric logs (empty: equal within ``REL_TOL``/``ABS_TOL``)."""
    out = []
    if len(expected) != len(got):
        out.append(f"{len(expected)} records expected, got {len(got)}")
    for e, g in zip(expected, got):
        for k in sorted(set(e) | set(g)):
            if not _same(e.get(k, "<absent>"), g.get(k, "<absent>")):
                out.append(f"step {e.get('step')}: {k}: expected {e.get(k, '<absent>')!r}, got {g.get(k, '<absent>')!r}")
    return out


def main(argv) -> int:
    if len(argv) != 2 or argv[0] not in ("record", "compare") or argv[1] not in RUNS:
        print(f"usage: {os.path.basename(__file__)} record|compare {'|'.join(RUNS)}")
        return 2
    mode, name = argv
    work = tempfile.mkdtemp(prefix=f"cegrpo_equiv_{name}_")
    try:
        recs = run(name, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if mode == "record":  # over this kind of host's record, else a new one beside the others
        base = _record_base(name)
        if os.path.exists(base + ".jsonl") and _differences_of(base + ".env.json"):
            base = os.path.join(HERE, "reference", f"{name}.{host_kind()}")
        os.makedirs(os.path.dirname(base), exist_ok=True)
        with open(base + ".jsonl", "w") as f:
            for r in recs:
                f.write(json.dumps(r, sort_keys=True) + "\n")
        with open(base + ".env.json", "w") as f:
            json.dump(dict(environment(), batch_wire=BATCH_WIRE), f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"recorded {len(recs)} records to {base}.jsonl (environment: {base}.env.json)")
        return 0
    diff, notes = compare_with_record(name, recs)
    for line in environment_differences(name):
        print(f"note: recorded in another environment: {line}")
    for line in notes:
        print(f"note: {line}")
    for line in diff:
        print(line)
    print(f"{name}: {'identical' if not diff else f'{len(diff)} differences'} ({len(recs)} records)")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
