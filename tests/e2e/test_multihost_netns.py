"""Two "hosts" on one machine: a 2-node DeepSpeed launch through two network namespaces.

Namespaces ``r0`` and ``r1`` (benchmarks/netns.py), joined by a veth pair, are the two
hosts; each runs ``examples/launch_multihost.sh`` in no-ssh mode with its NODE_RANK, the
hostfile below, MASTER_ADDR = r0's veth address and IFNAME = the veth, so every byte between
the hosts crosses the veth and nothing else joins them. The job is the tiny equivalence
run's (tests/equivalence/equivalence_runs.py: tiny-llama, PP=2, mask codec, anchor
c = K = 2), placed as docs/multihost.md describes: host 0 holds stage 0 (rank 0, the
driver), host 1 stage 1 (rank 1) and the anchor (rank 2, the last rank of the world).

Its metrics must equal, key for key and bit for bit (timings aside), the first two records
of the recorded single-host launch of the same job (tests/equivalence/reference/tiny.jsonl,
``deepspeed --num_gpus 3`` on loopback; tests/equivalence/test_equivalence.py checks that
today's code still reproduces that recording; on a host whose environment differs from the
record's, ``equivalence_runs.environment_differences``, that comparison is left out and the
rest still runs). Needs root and ``ip`` (skipped otherwise).
"""

import json
import os
import subprocess
import sys
import time

import pytest

from benchmarks.netns import Topology, kill_process_groups, netns_available
from distributed_util import PARITY_REWARD, REPO, launcher
from megatron_cegrpo.bootstrap import quiet_known_warnings
from equivalence.equivalence_runs import COMMON, RUNS, VOLATILE_PREFIXES, compare_with_record, environment_differences

ITERS = 2
#: the tiny equivalence run's flags without its checkpoint interval (this run saves nothing)
_SI = RUNS["tiny"]["args"].index("--save-interval")
TINY = RUNS["tiny"]["args"][:_SI] + RUNS["tiny"]["args"][_SI + 2:]
SUBNET = "10.214.0"  # only inside the test's namespaces
TIMEOUT_S = 600


def _veth_bytes(topo: Topology, node: int) -> dict:
    """rx/tx byte counters of ``node``'s veth, read inside its namespace (kernel counters)."""
    out = {}
    for d in ("rx", "tx"):
        p = subprocess.run(topo.exec_prefix(node) + ["cat", f"/sys/class/net/{topo.ifname}/statistics/{d}_bytes"],
                           capture_output=True, text=True, check=True)
        out[d] = int(p.stdout)
    return out


def _launch_two_hosts(topo: Topology, tmp_path) -> list:
    """Start ``launch_multihost.sh`` in both namespaces; wait; return each node's log text."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{topo.addrs[0]} slots=1\n{topo.addrs[1]} slots=2\n")  # stage 0 | stage 1 + anchor
    (tmp_path / "reward.py").write_text(PARITY_REWARD)
    flags = [*COMMON, *TINY, "--custom-reward-function", f"{tmp_path}/reward.py:parity_reward",
             "--train-iters", str(ITERS), "--log-dir", str(tmp_path / "run")]
    procs, logs, timed_out = [], [], False
    try:
        for node in range(2):
            env = dict(os.environ, NODE_RANK=str(node), HOSTFILE=str(hostfile), MASTER_ADDR=topo.addrs[0],
                       MASTER_PORT="29500", IFNAME=topo.ifname, DEEPSPEED=launcher("deepspeed"),
                       OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                       PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
            logs.append(open(tmp_path / f"node{node}.log", "w"))
            procs.append(subprocess.Popen(topo.exec_prefix(node) + ["bash", "examples/launch_multihost.sh", *flags],
                                          cwd=REPO, env=env, stdout=logs[-1], stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.monotonic() + TIMEOUT_S
        while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.2)
        if any(p.poll() for p in procs):  # one node failed: give the other a moment to report, then stop it
            time.sleep(2)
    finally:
        kill_process_groups(procs)
        for f in logs:
            f.close()
    texts = [(tmp_path / f"node{node}.log").read_text() for node in range(2)]
    tails = "\n".join(f"--- node {n} log:\n{t[-5000:]}" for n, t in enumerate(texts))
    assert not timed_out, f"the two-host launch still ran after {TIMEOUT_S} s (stopped):\n{tails}"
    for node, p in enumerate(procs):
        assert p.returncode == 0, f"node {node} exited {p.returncode}:\n{tails}"
    return texts


def test_two_namespace_launch_equals_the_single_host_run(tmp_path):
    why = netns_available(tools=("ip",))
    if why:
        pytest.skip(f"two-host launch needs network namespaces: {why}")
    topo = Topology(2, subnet=SUBNET, tag=f"cegrpo-bench-{os.getpid()}-hosts")
    try:
        topo.create()
    except RuntimeError as e:  # e.g. a container without CAP_SYS_ADMIN
        topo.destroy()
        pytest.skip(f"cannot create network namespaces here: {e}")
    try:
        texts = _launch_two_hosts(topo, tmp_path)
        veth = [_veth_bytes(topo, node) for node in range(2)]
    finally:
        topo.destroy()
    assert not set(topo.node_ns) & set(subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                      text=True).stdout.split())
    # each node's launcher started its own ranks: 0 on host 0, 1 and 2 on host 1
    assert "global_rank_mapping" in texts[0] and f"'{topo.addrs[1]}': [1, 2]" in texts[0]
    assert "nnodes=2, num_local_procs=1, node_rank=0" in texts[0]
    assert "nnodes=2, num_local_procs=2, node_rank=1" in texts[1]

    with open(tmp_path / "run" / "metrics.jsonl") as f:
        got = [{k: v for k, v in json.loads(x).items() if not k.startswith(VOLATILE_PREFIXES)} for x in f if x.strip()]
    assert [r["step"] for r in got] == list(range(1, ITERS + 1))
    if not environment_differences("tiny"):  # the record's sampled tokens are this host's (equivalence_runs)
        assert compare_with_record("tiny", got, limit=ITERS)[0] == []

    # the veth carried the traffic between the hosts: at least the metered payloads that must cross
    # (forward boundary and the rollout batch host 0 -> 1, backward boundary 1 -> 0), plus TCP/IP headers
    assert veth[0]["tx"] == veth[1]["rx"] and veth[1]["tx"] == veth[0]["rx"]
    assert veth[0]["tx"] > sum(r["comm/fwd_bytes"] + r["comm/batch_bytes"] for r in got)
    assert veth[1]["tx"] > sum(r["comm/bwd_bytes"] for r in got)


# --------------------------------------------------------------------------- placement and the script's checks


def _ranks_by_host(hostfile: str) -> dict:
    """host -> its global ranks, as DeepSpeed's launcher numbers them: hosts in the file's order,
    each taking the next ``slots`` ranks (deepspeed/launcher/launch.py, global_rank_mapping)."""
    from deepspeed.launcher.runner import fetch_hostfile

    out, nxt = {}, 0
    for host, slots in fetch_hostfile(hostfile).items():
        out[host], nxt = list(range(nxt, nxt + slots)), nxt + slots
    return out


@pytest.mark.parametrize("tp, dp, pp", [(1, 1, 2), (2, 2, 2), (2, 1, 3), (1, 4, 2)])
def test_slots_tp_times_dp_put_one_stage_per_host(tmp_path, tp, dp, pp):
    """docs/multihost.md's placement: with ``slots = TP x DP`` per stage host and the anchor's
    line last, megatron-core's groups (order tp-cp-ep-dp-pp) keep TP and DP inside a host, every
    pipeline group crosses all stage hosts once, and the anchor (rank TP*PP*DP) is alone."""
    quiet_known_warnings()  # megatron-core's "Transformer Engine and Apex are not installed" at import
    from megatron.core.parallel_state import RankGenerator

    hostfile = tmp_path / "hosts"
    hostfile.write_text("".join(f"stage{s}-host slots={tp * dp}\n" for s in range(pp)) + "anchor-host slots=1\n")
    placed = _ranks_by_host(str(hostfile))
    host_of = {r: h for h, ranks in placed.items() for r in ranks}
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    for kind in ("tp", "dp"):
        for group in gen.get_ranks(kind):
            assert len({host_of[r] for r in group}) == 1, (kind, group)
    for group in gen.get_ranks("pp"):
        assert [host_of[r] for r in group] == [f"stage{s}-host" for s in range(pp)]
    assert placed["anchor-host"] == [tp * pp * dp]


def test_hostfile_example_is_pp2_plus_the_anchor():
    placed = _ranks_by_host(os.path.join(REPO, "examples", "hostfile.example"))
    assert placed == {"stage0-host": [0], "stage1-host": [1], "anchor-host": [2]}

FAKE_DEEPSPEED = """#!/usr/bin/env bash
echo "ARGV $*"
echo "GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-}"
if [ -n "${DS_ENV_FILE:-}" ]; then echo "DS_ENV_FILE $DS_ENV_FILE"; cat "$DS_ENV_FILE"; fi
"""


def _script(tmp_path, env_extra: dict, *flags) -> subprocess.CompletedProcess:
    """Run examples/launch_multihost.sh with a stand-in launcher that prints what it was given."""
    fake = tmp_path / "fake_deepspeed"
    fake.write_text(FAKE_DEEPSPEED)
    fake.chmod(0o755)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two stage hosts and the anchor's\nh0 slots=1\nh1 slots=1\nh2 slots=1\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
                                                            "NODE_RANK", "MASTER_ADDR", "DS_ENV_FILE")}
    env.update(HOSTFILE=str(hostfile), MASTER_ADDR="10.0.0.1", DEEPSPEED=str(fake), OMP_NUM_THREADS="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + env["PATH"])  # the scripts' `python`: this venv's
    env.update(env_extra)
    env = {k: v for k, v in env.items() if v is not None}
    return subprocess.run(["bash", "examples/launch_multihost.sh", *flags], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def test_launch_script_builds_the_no_ssh_and_ssh_commands(tmp_path):
    p = _script(tmp_path, {"NODE_RANK": "2", "IFNAME": "lo", "MASTER_PORT": "29611"}, "--model", "tiny-llama")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == (f"ARGV --hostfile {tmp_path}/hosts --master_addr 10.0.0.1 --master_port 29611 "
                                        "--no_ssh --node_rank 2 megatron_cegrpo/train.py --model tiny-llama")
    assert "GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo" in p.stdout
    assert "launching node 2 of 3 (no ssh): 3 rank(s)" in p.stderr

    env_file = tmp_path / "ds_env"
    p = _script(tmp_path, {"IFNAME": "lo", "DS_ENV_FILE": str(env_file), "SSH_PORT": "2222"}, "--model", "tiny-llama")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == (f"ARGV --hostfile {tmp_path}/hosts --master_addr 10.0.0.1 --master_port 29500 "
                                        "--ssh_port 2222 megatron_cegrpo/train.py --model tiny-llama")
    # pdsh forwards only NCCL*/PYTHON*/... variables: the interface travels in DeepSpeed's env file
    assert env_file.read_text() == "GLOO_SOCKET_IFNAME=lo\nNCCL_SOCKET_IFNAME=lo\nOMP_NUM_THREADS=1\n"

    # no train.py flags: the demo's job (examples/run_smollm2_mawps.sh) under the multi-host launcher
    p = _script(tmp_path, {"NODE_RANK": "0"})
    assert p.returncode == 0, p.stderr
    argv = p.stdout.splitlines()[0]
    assert argv.startswith(f"ARGV --hostfile {tmp_path}/hosts --master_addr 10.0.0.1 --master_port 29500 "
                           "--no_ssh --node_rank 0 megatron_cegrpo/train.py --model smollm2-135m-instruct ")
    assert "--anchor-ranks 1 " in argv and "--num_gpus" not in argv


@pytest.mark.parametrize("env_extra, message", [
    ({"MASTER_ADDR": None}, "MASTER_ADDR is not set; fix: MASTER_ADDR=<address of the hostfile's first host"),
    ({"NODE_RANK": "3"}, "NODE_RANK=3 but {hosts} lists 3 host(s); fix: NODE_RANK in 0..2"),
    ({"NODE_RANK": "one"}, "NODE_RANK=one is not a number; fix: this host's 0-based line in {hosts}"),
    ({"IFNAME": "nosuch0"}, "IFNAME=nosuch0 is not an interface of this host; fix: one of "),
    ({"MASTER_PORT": "29x"}, "MASTER_PORT=29x is not a port number; fix: MASTER_PORT=29500"),
    ({"HOSTFILE": "/nonexistent/hosts"}, "HOSTFILE=/nonexistent/hosts does not exist; fix: point HOSTFILE at"),
], ids=["no-master-addr", "node-rank-too-big", "node-rank-not-a-number", "no-such-interface", "bad-port",
        "no-hostfile"])
def test_launch_script_rejects_a_bad_environment_in_one_line(tmp_path, env_extra, message):
    p = _script(tmp_path, env_extra, "--model", "tiny-llama")
    assert p.returncode == 2 and p.stdout == ""  # the launcher never started
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("[cegrpo] error: " + message.format(hosts=tmp_path / "hosts"))
