#!/usr/bin/env bash
# roll's container entry point: one subcommand per thing a container of a roll image does.
#
#   train ARGS...            roll-train ARGS (Hydra overrides)
#   eval ARGS...             roll-eval ARGS (a checkpoint folder, then overrides)
#   quickstart [ARGS...]     roll-train experiment=quickstart ARGS (unless ARGS choose an experiment=)
#   doctor [ARGS...]         roll-doctor: what roll sees (platform, devices, engines); the image's default
#   ray-head [RAY ARGS...]   a Ray head node in the foreground (GCS on $RAY_PORT, dashboard on 0.0.0.0:8265)
#   ray-worker [RAY ARGS...] a Ray worker node joining $RAY_ADDRESS (host:port of the head), in the foreground
#   ray-job CMD [ARGS...]    join $RAY_ADDRESS as a node with no CPUs or GPUs (a Ray driver must run on a node of
#                            its cluster), run the subcommand CMD (train, eval, quickstart, ...), leave the
#                            cluster, exit with CMD's status
#   health                   the image's HEALTHCHECK: a Ray node checks its GCS and its raylet; anything else is
#                            healthy while it runs
#   help                     this text
# Any other command is exec'd as given (`bash`, `python -c ...`, `ray status`).
# RAY_START_ARGS: extra `ray start` options (space-separated) for every Ray node a container starts: ray-head,
# ray-worker and the node of ray-job (e.g. --node-ip-address=..., --object-store-memory=...).
set -euo pipefail

RAY_PORT=${RAY_PORT:-6379}
RAY_DASHBOARD_PORT=${RAY_DASHBOARD_PORT:-8265}
# Which Ray role this container started (read by `health`); /tmp is the container's own.
ROLE_FILE=${ROLL_ROLE_FILE:-/tmp/roll-container-role}

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
}

die() {
  echo "roll-entrypoint: $*" >&2
  exit 2
}

# Ascend images: torch_npu finds the CANN libraries through the variables CANN's set_env.sh exports.
for env_script in /usr/local/Ascend/ascend-toolkit/set_env.sh /usr/local/Ascend/nnal/atb/set_env.sh; do
  if [ -f "$env_script" ]; then
    # shellcheck source=/dev/null
    . "$env_script"
  fi
done

# Ray's token authentication: a token given to every container of the cluster turns it on for all of them (a node
# started without it could not join, and one started with it refuses nodes that lack it).
if [ -n "${RAY_AUTH_TOKEN:-}" ]; then
  export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
else
  unset RAY_AUTH_TOKEN
fi

# Word-split on purpose: several options in one variable.
read -r -a RAY_START_EXTRA <<<"${RAY_START_ARGS:-}"

need_address() {
  [ -n "${RAY_ADDRESS:-}" ] || die "$1 needs RAY_ADDRESS=<head host>:<port> (the head's GCS, e.g. ray-head:6379)"
}

run() {
  local cmd=${1:-doctor}
  [ "$#" -gt 0 ] && shift
  case "$cmd" in
    train) exec roll-train "$@" ;;
    eval) exec roll-eval "$@" ;;
    quickstart)
      # Like `nox -s quickstart`: an experiment= among the arguments replaces the default one.
      local arg
      for arg in "$@"; do
        case "$arg" in experiment=*) exec roll-train "$@" ;; esac
      done
      exec roll-train experiment=quickstart "$@"
      ;;
    doctor) exec roll-doctor "$@" ;;
    ray-head)
      echo ray-head >"$ROLE_FILE"
      exec ray start --head --port="$RAY_PORT" --dashboard-host=0.0.0.0 --dashboard-port="$RAY_DASHBOARD_PORT" \
        --block "${RAY_START_EXTRA[@]}" "$@"
      ;;
    ray-worker)
      need_address ray-worker
      echo ray-worker >"$ROLE_FILE"
      exec ray start --address="$RAY_ADDRESS" --block "${RAY_START_EXTRA[@]}" "$@"
      ;;
    ray-job)
      need_address ray-job
      [ "$#" -gt 0 ] || die "ray-job needs a subcommand to run on the cluster (train, eval, quickstart, ...)"
      case "$1" in ray-head | ray-worker | ray-job) die "ray-job runs a job, not another Ray node ($1)" ;; esac
      ray start --address="$RAY_ADDRESS" --num-cpus=0 --num-gpus=0 "${RAY_START_EXTRA[@]}"
      # Not exec: the node this container added leaves the cluster when the job ends, whatever its status.
      local status=0
      (run "$@") || status=$?
      ray stop || echo "roll-entrypoint: ray stop failed (the job's status is kept)" >&2
      exit "$status"
      ;;
    health)
      local role=""
      [ -f "$ROLE_FILE" ] && role=$(cat "$ROLE_FILE")
      case "$role" in
        ray-head) exec ray health-check --address "127.0.0.1:$RAY_PORT" ;;
        ray-worker)
          # The head answers, and this node's raylet is up (its socket exists once `ray start` has joined; Ray
          # keeps its session under $RAY_TMPDIR/ray, /tmp/ray by default).
          ray health-check --address "$RAY_ADDRESS"
          [ -S "${RAY_TMPDIR:-/tmp}/ray/session_latest/sockets/raylet" ] || die "health: this node's raylet is not running"
          ;;
        *) exit 0 ;;
      esac
      ;;
    help | -h | --help) usage ;;
    *) exec "$cmd" "$@" ;;
  esac
}

run "$@"
