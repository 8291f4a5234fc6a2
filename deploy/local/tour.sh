#!/usr/bin/env bash
# The mesh tour: starts the whole Sleuth mesh locally (Redis + six services, authentication
# on) over a small collection the demo writes itself, shows every service
# healthy with `sleuth health`, searches the collection and asks the policy
# (SmolLM2-135M-Instruct) a question, then stops everything with SIGTERM and
# reports how each service shut down.
#
# Run through `make tour`, which builds first and sets CARGO_TARGET_DIR.
#   SLEUTH_DEMO_BASE_PORT  first of the nine consecutive ports used (default 50051)
set -euo pipefail

mesh_name=tour
source "$(dirname "$0")/mesh.sh"
work="$(mktemp -d -t sleuth-tour-XXXXXX)"
mesh_init "$work"
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
export SLEUTH_RUN_ID=demo SLEUTH_COLLECTIONS="weather=$work/weather-index"
for name in rollout-orchestrator agent tool-gateway inference-gateway policy-server learner; do
  mesh_start "$name"
done

say "waiting for every service to report SERVING"
mesh_health

say "searching the collection (vector search): what makes ice fall from storms?"
"$bin/sleuth" search --tool-gateway "$SLEUTH_TOOL_GATEWAY" --collection weather --method vector -k 3 \
  "what makes ice fall from storms?"

say "asking the policy: What is the capital of France?"
"$bin/sleuth" ask --policy-server "$SLEUTH_POLICY_SERVERS" "What is the capital of France?"

say "one agent turn through the OpenAI-compatible endpoint of the inference gateway (episode demo-1)"
curl -sS "http://127.0.0.1:$http_port/episodes/demo-1/v1/chat/completions" \
  -H "authorization: Bearer $SLEUTH_AUTH_TOKEN" -H "content-type: application/json" \
  -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0, "max_tokens": 24}'
echo

say "an evaluation job on the orchestrator: the BM25 baseline on the demo collection"
"$bin/sleuth" eval --orchestrator "$orchestrator" --source "$work/weather" --collection weather --contender bm25

say "the orchestrator's dashboard lists that evaluation: http://127.0.0.1:$dashboard_port/evaluations"
curl -sS -H "authorization: Bearer $SLEUTH_AUTH_TOKEN" "http://127.0.0.1:$dashboard_port/evaluations" \
  | grep -o 'eval-[0-9a-f]*</td><td>baseline:bm25[^<]*' | head -n 1 | sed 's|</td><td>| |'

say "stopping the mesh with SIGTERM"
status=0
for name in rollout-orchestrator agent tool-gateway inference-gateway policy-server learner; do
  mesh_stop "$name" || status=1
done
exit $status
