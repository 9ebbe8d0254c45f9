#!/usr/bin/env bash
# Launch the trainer across N hosts with DeepSpeed's multi-node launcher (deepspeed 0.19.8).
# docs/multihost.md explains the hostfile, ports, interfaces and rank placement.
#
# Two modes, the same hostfile and flags in both:
#
#   no-ssh (run this on EVERY host, each with its own NODE_RANK = its line in the hostfile):
#     NODE_RANK=0 MASTER_ADDR=10.0.0.1 IFNAME=eth0 bash examples/launch_multihost.sh [train.py flags]
#     NODE_RANK=1 MASTER_ADDR=10.0.0.1 IFNAME=eth0 bash examples/launch_multihost.sh [train.py flags]
#     ...  -> deepspeed --hostfile H --no_ssh --node_rank R --master_addr A --master_port P
#
#   ssh (run this ONCE, on the host of the hostfile's first line; needs passwordless ssh to
#   every host, pdsh installed, and this checkout and its .venv at the same path everywhere):
#     MASTER_ADDR=10.0.0.1 IFNAME=eth0 bash examples/launch_multihost.sh [train.py flags]
#     ...  -> deepspeed --hostfile H --master_addr A --master_port P  (pdsh starts every node)
#
# Environment:
#   HOSTFILE     DeepSpeed hostfile (default examples/hostfile.example: PP=2 + 1 anchor rank)
#   MASTER_ADDR  address of the hostfile's first host (rank 0's TCP store), reachable from
#                every host on IFNAME (required)
#   MASTER_PORT  TCP port of that store on the first host (default 29500)
#   IFNAME       network interface the ranks talk on: exported as GLOO_SOCKET_IFNAME (CPU,
#                gloo) and NCCL_SOCKET_IFNAME (GPU, NCCL) unless those are already set
#   NODE_RANK    this host's line in the hostfile (0-based); set = no-ssh mode
#   DEEPSPEED    the launcher (default: .venv/bin/deepspeed if present, else `deepspeed`)
#   SSH_PORT     ssh mode: the ssh port, if not 22
#   DS_ENV_FILE  ssh mode: where the environment file for pdsh is written (absolute path;
#                default runs/multihost.deepspeed_env)
#
# Flags after the script are train.py's flags (the whole command line of the job). Without
# any, the demo's job runs (examples/run_smollm2_mawps.sh: SmolLM2-135M, PP=2, one anchor).
# The world (the sum of the hostfile's slots) must equal TP x PP x DP + --anchor-ranks;
# train.py checks it at start-up and stops with one line naming the flags.
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "[cegrpo] error: $*" >&2; exit 2; }

HOSTFILE=${HOSTFILE:-examples/hostfile.example}
MASTER_PORT=${MASTER_PORT:-29500}
[ -f "$HOSTFILE" ] || die "HOSTFILE=$HOSTFILE does not exist; fix: point HOSTFILE at a DeepSpeed hostfile (see examples/hostfile.example)"
[ -n "${MASTER_ADDR:-}" ] || die "MASTER_ADDR is not set; fix: MASTER_ADDR=<address of the hostfile's first host, reachable from every host>"
case "$MASTER_PORT" in ''|*[!0-9]*) die "MASTER_PORT=$MASTER_PORT is not a port number; fix: MASTER_PORT=29500" ;; esac
HOSTS=$(grep -cE '^[[:space:]]*[^#[:space:]]+[[:space:]]+slots=[0-9]+' "$HOSTFILE" || true)
SLOTS=$(sed -nE 's/^[[:space:]]*[^#[:space:]]+[[:space:]]+slots=([0-9]+).*/\1/p' "$HOSTFILE" | awk '{s += $1} END {print s + 0}')
[ "$HOSTS" -ge 1 ] || die "HOSTFILE=$HOSTFILE lists no '<host> slots=<n>' line; fix: one such line per host"

if [ -n "${IFNAME:-}" ]; then
  [ -e "/sys/class/net/$IFNAME" ] || die "IFNAME=$IFNAME is not an interface of this host; fix: one of $(ls /sys/class/net | paste -sd' ' -)"
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$IFNAME}
  export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$IFNAME}
fi

if [ -z "${DEEPSPEED:-}" ]; then
  if [ -x .venv/bin/deepspeed ]; then DEEPSPEED=.venv/bin/deepspeed; else DEEPSPEED=deepspeed; fi
fi
LAUNCH=(--hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")

if [ -n "${NODE_RANK:-}" ]; then
  case "$NODE_RANK" in ''|*[!0-9]*) die "NODE_RANK=$NODE_RANK is not a number; fix: this host's 0-based line in $HOSTFILE" ;; esac
  [ "$NODE_RANK" -lt "$HOSTS" ] || die "NODE_RANK=$NODE_RANK but $HOSTFILE lists $HOSTS host(s); fix: NODE_RANK in 0..$((HOSTS - 1))"
  LAUNCH+=(--no_ssh --node_rank "$NODE_RANK")
  WHERE="node $NODE_RANK of $HOSTS (no ssh)"
else
  # pdsh forwards only variables named NCCL*/PYTHON*/...: the socket interface (and the thread
  # count) travel in a DeepSpeed environment file, read by the launcher on the first host.
  # DS_ENV_FILE (DeepSpeed's name for that file) may be set to an absolute path; default
  # runs/multihost.deepspeed_env in this checkout.
  export DS_ENV_FILE=${DS_ENV_FILE:-$PWD/runs/multihost.deepspeed_env}
  mkdir -p "$(dirname "$DS_ENV_FILE")"
  : > "$DS_ENV_FILE"
  for v in GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME OMP_NUM_THREADS; do
    if [ -n "${!v:-}" ]; then echo "$v=${!v}" >> "$DS_ENV_FILE"; fi
  done
  [ -z "${SSH_PORT:-}" ] || LAUNCH+=(--ssh_port "$SSH_PORT")
  WHERE="all $HOSTS hosts through pdsh/ssh"
fi

echo "[cegrpo] launching $WHERE: $SLOTS rank(s) from $HOSTFILE, store $MASTER_ADDR:$MASTER_PORT," \
     "interface ${GLOO_SOCKET_IFNAME:-(default route)}" >&2
if [ "$#" -gt 0 ]; then
  exec "$DEEPSPEED" "${LAUNCH[@]}" megatron_cegrpo/train.py "$@"
fi
DEEPSPEED="$DEEPSPEED" DS_LAUNCH_ARGS="${LAUNCH[*]}" exec bash examples/run_smollm2_mawps.sh
