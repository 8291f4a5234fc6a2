# Starts and stops a local Sleuth mesh (Redis + services, authentication on);
# sourced by tour.sh and train.sh, never run alone.
#
#   mesh_init WORK      ports from SLEUTH_DEMO_BASE_PORT (default 50051, nine
#                       consecutive ports), a fresh token, the common settings
#   mesh_start NAME     starts service NAME (its log: WORK/NAME.log); extra
#                       settings come from the environment of the call
#   mesh_stop NAME      SIGTERM, waits, reports how it stopped (status 1 if not cleanly)
#   mesh_health         waits until every started service reports SERVING
#
# Every process started here is stopped when the calling script exits.

mesh_base="${SLEUTH_DEMO_BASE_PORT:-50051}"
bin="${CARGO_TARGET_DIR:?run through make}/debug"
declare -A mesh_port=(
  [rollout-orchestrator]=$mesh_base [agent]=$((mesh_base + 1)) [tool-gateway]=$((mesh_base + 2))
  [inference-gateway]=$((mesh_base + 3)) [policy-server]=$((mesh_base + 4)) [learner]=$((mesh_base + 5))
)
# Not exported: a learner given the orchestrator trains the run it names there.
orchestrator="127.0.0.1:$mesh_base"
redis_port=$((mesh_base + 6))
http_port=$((mesh_base + 7))
dashboard_port=$((mesh_base + 8))
declare -A mesh_pid=()
mesh_pids=()

say() { printf '\033[1m%s:\033[0m %s\n' "${mesh_name:-sleuth}" "$*"; }

mesh_stop_all() {
  for pid in "${mesh_pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${mesh_pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}

mesh_init() {
  mesh_work="$1"
  for port in $(seq "$mesh_base" "$dashboard_port"); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      echo "port $port is in use; set SLEUTH_DEMO_BASE_PORT to a free range" >&2
      exit 1
    fi
  done
  trap mesh_stop_all EXIT
  redis-server --bind 127.0.0.1 --port "$redis_port" --save '' --appendonly no --dir "$mesh_work" \
    >"$mesh_work/redis.log" 2>&1 &
  mesh_pids+=($!)
  SLEUTH_AUTH_TOKEN="demo-$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')"
  # The key episode tickets are signed with (the orchestrator issues them, the inference gateway checks them).
  SLEUTH_TICKET_KEY="demo-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
  export SLEUTH_AUTH_TOKEN SLEUTH_TICKET_KEY SLEUTH_REDIS_URL="redis://127.0.0.1:$redis_port/0"
  export SLEUTH_DATABASE_URL="sqlite://$mesh_work/sleuth.db" SLEUTH_DEVICE=cpu SLEUTH_DRAIN_TIMEOUT=5s
  export SLEUTH_CHECKPOINT_URI="$mesh_work/checkpoints" SLEUTH_REPORT_DIR="$mesh_work/evaluations"
  # A local mesh serves its own user, on loopback: task sets (SOURCE, COLLECTION) may be
  # any directory of this machine. A shared orchestrator names its data folders instead.
  export SLEUTH_TASK_ROOTS="${SLEUTH_TASK_ROOTS:-/}"
  export SLEUTH_POLICY_SERVERS="127.0.0.1:${mesh_port[policy-server]}"
  export SLEUTH_INFERENCE_GATEWAY="127.0.0.1:${mesh_port[inference-gateway]}"
  export SLEUTH_TOOL_GATEWAY="127.0.0.1:${mesh_port[tool-gateway]}"
  export SLEUTH_AGENT_WORKERS="127.0.0.1:${mesh_port[agent]}"
  # The whole mesh shares this machine's cores: waiting OpenMP threads sleep instead of spinning.
  export OMP_WAIT_POLICY=passive
}

mesh_start() {
  local name="$1" http=""
  case "$name" in
    inference-gateway) http="127.0.0.1:$http_port" ;;
    rollout-orchestrator) http="127.0.0.1:$dashboard_port" ;;
  esac
  SLEUTH_LISTEN="127.0.0.1:${mesh_port[$name]}" SLEUTH_HTTP_LISTEN="$http" \
    "$bin/$name" >>"$mesh_work/$name.log" 2>&1 &
  mesh_pids+=($!)
  mesh_pid[$name]=$!
  local where="127.0.0.1:${mesh_port[$name]}"
  [[ "${mesh_port[$name]}" != 0 ]] || where="a port the system picks"
  say "started $name on $where (pid $!)"
}

mesh_stop() {
  local name="$1" pid="${mesh_pid[$1]}" start
  start=$(date +%s%N)
  kill -TERM "$pid"
  if wait "$pid"; then
    say "$name stopped cleanly in $(( ($(date +%s%N) - start) / 1000000 )) ms"
  else
    say "$name exited with status $? (see $mesh_work/$name.log)"
    return 1
  fi
}

mesh_health() {
  local flags=() name
  for name in "${!mesh_port[@]}"; do
    if [[ -z "${mesh_pid[$name]:-}" ]]; then
      flags+=(--skip "$name")
    elif [[ "$name" == rollout-orchestrator ]]; then
      flags+=(--orchestrator "127.0.0.1:${mesh_port[$name]}")
    else
      flags+=("--$name" "127.0.0.1:${mesh_port[$name]}")
    fi
  done
  "$bin/sleuth" health --wait 90s "${flags[@]}"
}
