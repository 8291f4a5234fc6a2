#!/usr/bin/env bash
# Starts the whole Sleuth mesh locally (Redis + six services, authentication
# on) over a small collection the demo writes itself, shows every service
# healthy with `sleuth health`, searches the collection and asks the policy
# (SmolLM2-135M-Instruct) a question, then stops everything with SIGTERM and
# reports how each service shut down.
#
# Run through `make demo`, which builds first and sets CARGO_TARGET_DIR.
#   SLEUTH_DEMO_BASE_PORT  first of the nine consecutive ports used (default 50051)
set -euo pipefail

bin="${CARGO_TARGET_DIR:?run through make demo}/debug"
base="${SLEUTH_DEMO_BASE_PORT:-50051}"
work="$(mktemp -d -t sleuth-demo-XXXXXX)"
token="demo-$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')"
redis_port=$((base + 6))
http_port=$((base + 7))
dashboard_port=$((base + 8))
pids=()

say() { printf '\033[1mdemo:\033[0m %s\n' "$*"; }

for port in $(seq "$base" "$dashboard_port"); do
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

# A small BEIR collection of its own, indexed for BM25 and vector search.
mkdir -p "$work/weather/qrels"
cat >"$work/weather/corpus.jsonl" <<'CORPUS'
{"_id": "rain", "title": "Rainfall", "text": "Rain forms when water droplets in clouds grow heavy enough to fall."}
{"_id": "snow", "title": "Snow", "text": "Snowflakes are ice crystals that form in cold clouds and fall to the ground."}
{"_id": "wind", "title": "Wind", "text": "Wind is air moving from areas of high pressure to areas of low pressure."}
{"_id": "fog", "title": "Fog", "text": "Fog is a cloud at ground level, made of tiny water droplets suspended in air."}
{"_id": "hail", "title": "Hail", "text": "Hailstones grow in thunderstorm updrafts as layers of ice accumulate."}
CORPUS
echo '{"_id": "q1", "text": "why does it rain"}' >"$work/weather/queries.jsonl"
printf 'query-id\tcorpus-id\tscore\nq1\train\t1\n' >"$work/weather/qrels/test.tsv"
"$bin/tool-gateway" index --source "$work/weather" --out "$work/weather-index" --name weather --vectors 2>/dev/null
redis-server --bind 127.0.0.1 --port "$redis_port" --save '' --appendonly no --dir "$work" >"$work/redis.log" 2>&1 &
pids+=($!)

export SLEUTH_AUTH_TOKEN="$token" SLEUTH_REDIS_URL="redis://127.0.0.1:$redis_port/0"
export SLEUTH_DATABASE_URL="sqlite://$work/sleuth.db" SLEUTH_DEVICE=cpu SLEUTH_DRAIN_TIMEOUT=5s
export SLEUTH_RUN_ID=demo SLEUTH_CHECKPOINT_URI="$work/checkpoints" SLEUTH_REPORT_DIR="$work/evaluations"
# The whole mesh shares this machine's cores: waiting OpenMP threads sleep instead of spinning.
export OMP_WAIT_POLICY=passive
services=(rollout-orchestrator agent tool-gateway inference-gateway policy-server learner)
declare -A service_pid
for i in "${!services[@]}"; do
  name="${services[$i]}"
  port=$((base + i))
  # The HTTP port of the two services that have one.
  case "$name" in
    inference-gateway) http="127.0.0.1:$http_port" ;;
    rollout-orchestrator) http="127.0.0.1:$dashboard_port" ;;
    *) http="" ;;
  esac
  SLEUTH_LISTEN="127.0.0.1:$port" \
  SLEUTH_POLICY_SERVERS="127.0.0.1:$((base + 4))" \
  SLEUTH_INFERENCE_GATEWAY="127.0.0.1:$((base + 3))" \
  SLEUTH_TOOL_GATEWAY="127.0.0.1:$((base + 2))" \
  SLEUTH_AGENT_WORKERS="127.0.0.1:$((base + 1))" \
  SLEUTH_COLLECTIONS="weather=$work/weather-index" \
  SLEUTH_HTTP_LISTEN="$http" \
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

say "searching the collection (vector search): what makes ice fall from storms?"
"$bin/sleuth" search --tool-gateway "127.0.0.1:$((base + 2))" --collection weather --method vector -k 3 \
  "what makes ice fall from storms?"

say "asking the policy: What is the capital of France?"
"$bin/sleuth" ask --policy-server "127.0.0.1:$((base + 4))" "What is the capital of France?"

say "one agent turn through the OpenAI-compatible endpoint of the inference gateway (episode demo-1)"
curl -sS "http://127.0.0.1:$http_port/episodes/demo-1/v1/chat/completions" \
  -H "authorization: Bearer $token" -H "content-type: application/json" \
  -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0, "max_tokens": 24}'
echo

say "an evaluation job on the orchestrator: the BM25 baseline on the demo collection"
"$bin/sleuth" eval --orchestrator "127.0.0.1:$base" --source "$work/weather" --collection weather --contender bm25

say "the orchestrator's dashboard lists that evaluation: http://127.0.0.1:$dashboard_port/evaluations"
curl -sS -H "authorization: Bearer $token" "http://127.0.0.1:$dashboard_port/evaluations" \
  | grep -o 'eval-[0-9a-f]*</td><td>baseline:bm25[^<]*' | head -n 1 | sed 's|</td><td>| |'

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
