#!/usr/bin/env bash
# Starts the whole Sleuth mesh locally (Redis + six services, authentication
# on), shows every service healthy with `sleuth health`, then stops everything
# with SIGTERM and reports how each service shut down.
#
# Run through `make demo`, which builds first and sets CARGO_TARGET_DIR.
#   SLEUTH_DEMO_BASE_PORT  first of the seven consecutive ports used (default 50051)
set -euo pipefail

bin="${CARGO_TARGET_DIR:?run through make demo}/debug"
base="${SLEUTH_DEMO_BASE_PORT:-50051}"
work="$(mktemp -d -t sleuth-demo-XXXXXX)"
token="demo-$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')"
redis_port=$((base + 6))
pids=()

say() { printf '\033[1mdemo:\033[0m %s\n' "$*"; }

for port in $(seq "$base" "$redis_port"); do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "port $port is in use; set SLEUTH_DEMO_BASE_PORT to a free range" >&2
    exit 1
  fi
done

stop_all() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap stop_all EXIT

say "logs in $work"
redis-server --bind 127.0.0.1 --port "$redis_port" --save '' --appendonly no --dir "$work" >"$work/redis.log" 2>&1 &
pids+=($!)

export SLEUTH_AUTH_TOKEN="$token" SLEUTH_REDIS_URL="redis://127.0.0.1:$redis_port/0"
export SLEUTH_DATABASE_URL="sqlite://$work/sleuth.db" SLEUTH_DEVICE=cpu SLEUTH_DRAIN_TIMEOUT=5s
services=(rollout-orchestrator agent tool-gateway inference-gateway policy-server learner)
declare -A service_pid
for i in "${!services[@]}"; do
  name="${services[$i]}"
  port=$((base + i))
  SLEUTH_LISTEN="127.0.0.1:$port" \
  SLEUTH_POLICY_SERVERS="127.0.0.1:$((base + 4))" \
  SLEUTH_INFERENCE_GATEWAY="127.0.0.1:$((base + 3))" \
  SLEUTH_TOOL_GATEWAY="127.0.0.1:$((base + 2))" \
    "$bin/$name" >"$work/$name.log" 2>&1 &
  pids+=($!)
  service_pid[$name]=$!
  say "started $name on 127.0.0.1:$port (pid $!)"
done

say "waiting for every service to report SERVING"
"$bin/sleuth" health --wait 90s \
  --orchestrator "127.0.0.1:$base" --agent "127.0.0.1:$((base + 1))" \
  --tool-gateway "127.0.0.1:$((base + 2))" --inference-gateway "127.0.0.1:$((base + 3))" \
  --policy-server "127.0.0.1:$((base + 4))" --learner "127.0.0.1:$((base + 5))"

say "listing the tool gateway's API through reflection"
if command -v grpcurl >/dev/null; then
  grpcurl -plaintext -H "authorization: Bearer $token" "127.0.0.1:$((base + 2))" list
else
  say "(grpcurl not installed; skipping)"
fi

say "stopping the mesh with SIGTERM"
status=0
for name in "${services[@]}"; do
  pid="${service_pid[$name]}"
  start=$(date +%s%N)
  kill -TERM "$pid"
  if wait "$pid"; then
    say "$name stopped cleanly in $(( ($(date +%s%N) - start) / 1000000 )) ms"
  else
    say "$name exited with status $? (see $work/$name.log)"
    status=1
  fi
done
exit $status
