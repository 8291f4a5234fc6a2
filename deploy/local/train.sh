#!/usr/bin/env bash
# Trains a search agent for a BEIR collection with the whole recipe on a
# local mesh, and shows whether it got better:
#
#   1. index the collection (BM25; --vectors or --hybrid-row add vector search),
#      and choose the agent's opening search on the validation split: the
#      search of the question (BM25, BM25+RM3, with vectors hybrid) whose
#      nDCG@10 there is highest; print which of its listed leads reach the
#      next judged document (`tool-gateway leads`);
#   2. the base policy: --policy DIR, or a fresh tiny one made for the
#      collection (`learner init-policy` with copy pre-training);
#   3. start the mesh (Redis, orchestrator, agent worker, tool gateway,
#      inference gateway, policy server) with the base;
#   4. trajectory SFT on half of the train questions: a run whose episodes
#      a teacher plays (`agent.teacher`: the scripted mixture, or --teacher), trained on each
#      question's best (rejection sampling) rewarded at least `sft_min_reward` (answering in
#      words, with copy pre-training's conversations rehearsed in every step), validated every few steps;
#      every episode opens with the chosen search of the question
#      (`agent.opening_search`), so each turn chooses between following a
#      bridge named in the results and submitting;
#   5. GRPO on the other half, from the policy the SFT run ended with
#      (`policy.from_run`), the policy's own episodes, validated every few steps;
#      with several --grpo settings, one run per setting, and the table's GRPO
#      is the run whose best version scores highest on validation;
#   6. evaluate on the test split: BM25, BM25+RM3 and (with vectors) hybrid
#      search on the question, the scripted multi-hop search chosen on
#      validation, the teacher, the base, SFT and GRPO (each run's
#      best version by validation, never by training reward), and print one
#      table with nDCG@10 and its paired 95 % bootstrap interval against SFT.
#
# With --task answer the agent answers in words and cites documents
# (`submit_answer`, reward `answer+citations`, docs/rewards.md): the fresh
# policy's copy pre-training answers with the entities it copies, both runs
# are rewarded by answer F1 x citation F1, and the tables compare answer F1,
# citation F1 and their product (the search baselines rank, so they have no
# row there).
#
# Usage (through make, which builds first and sets CARGO_TARGET_DIR):
#   make train SOURCE=DIR COLLECTION=NAME [ARGS="--policy DIR --vectors ..."]
#   deploy/local/train.sh --source DIR --collection NAME [options]
# Options:
#   --policy DIR        start from this HF model directory (default: a fresh tiny policy)
#   --work DIR          where everything goes (default: a new temporary directory)
#   --vectors           index for vector search too (embeds every document: minutes)
#                       and offer the agent vector_search
#   --hybrid-row        index for vector search too, for the table's hybrid row
#                       (hybrid search on the question) and as a candidate opening search
#   --opening-search T  the agent's opening search: bm25_search, rm3_search or
#                       hybrid_search (default: whichever scores best on validation)
#   --copy-steps N      copy pre-training steps of the fresh policy (default 800)
#   --train-limit N     train questions used (default 0: all)
#   --eval-limit N      validation and test questions used (default 0: all)
#   --sft-epochs N      passes over SFT's half of the train questions (default 2)
#   --grpo-epochs N     passes over GRPO's half with the policy (default 4)
#   --grpo LR:KL:T,...  GRPO's learning rate, KL coefficient and sampling
#                       temperature (default 3e-4:1.0:0.7); several settings
#                       train one run each, chosen on validation
#   --validation-only   stop after training: print each run's best validation
#                       score and the chosen GRPO's against SFT's, paired by
#                       question, and evaluate nothing on the test split (for
#                       choosing settings without looking at test)
#   --task T            ranking (default) or answer (in words, with citations)
#   --teacher T         who plays SFT's episodes (default mixture): a scripted
#                       strategy, or model:NAME, the model NAME at the
#                       OpenAI-compatible endpoint SLEUTH_TEACHER_URL (token in
#                       SLEUTH_TEACHER_TOKEN), e.g. a larger model served on a GPU
# The collection needs qrels/train.tsv and qrels/test.tsv; without
# qrels/validation.tsv a seventh of the train questions is held out to validate.
#   SLEUTH_DEMO_BASE_PORT  first of the nine consecutive ports used (default 50051)
set -euo pipefail

mesh_name=train
source "$(dirname "$0")/mesh.sh"

source="" collection="" policy="" work="" vectors=0 index_vectors=0
copy_steps=800 train_limit=0 eval_limit=0 sft_epochs=2 grpo_epochs=4 task=ranking
grpo_settings=3e-4:1.0:0.7 validation_only=0 teacher=mixture opening=""
usage() { sed -n '2,/^set -euo/{/^#/p}' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
while (($#)); do
  case "$1" in
    --source) source="$2"; shift 2 ;;
    --collection) collection="$2"; shift 2 ;;
    --policy) policy="$2"; shift 2 ;;
    --work) work="$2"; shift 2 ;;
    --vectors) vectors=1 index_vectors=1; shift ;;
    --hybrid-row) index_vectors=1; shift ;;
    --copy-steps) copy_steps="$2"; shift 2 ;;
    --train-limit) train_limit="$2"; shift 2 ;;
    --eval-limit) eval_limit="$2"; shift 2 ;;
    --sft-epochs) sft_epochs="$2"; shift 2 ;;
    --grpo-epochs) grpo_epochs="$2"; shift 2 ;;
    --grpo) grpo_settings="$2"; shift 2 ;;
    --validation-only) validation_only=1; shift ;;
    --task) task="$2"; shift 2 ;;
    --teacher) teacher="$2"; shift 2 ;;
    --opening-search) opening="$2"; shift 2 ;;
    -h|--help) usage ;;
    *) echo "unknown option $1" >&2; usage ;;
  esac
done
[[ -n "$source" && -n "$collection" ]] || { echo "--source and --collection are required" >&2; usage; }
# The agent worker reads the endpoint from its environment (mesh.sh passes it on).
[[ "$teacher" != model:* || -n "${SLEUTH_TEACHER_URL:-}" ]] \
  || { echo "--teacher $teacher: set SLEUTH_TEACHER_URL to the teacher model's OpenAI-compatible endpoint" >&2; exit 2; }
IFS=, read -ra grpo_runs <<<"$grpo_settings"
for setting in "${grpo_runs[@]}"; do
  [[ "$setting" =~ ^[0-9.eE+-]+:[0-9.eE+-]+:[0-9.eE+-]+$ ]] \
    || { echo "--grpo $grpo_settings: each setting is LEARNING_RATE:KL_COEF:TEMPERATURE, got '$setting'" >&2; exit 2; }
done
for split in train test; do
  [[ -f "$source/qrels/$split.tsv" ]] || { echo "--source $source has no qrels/$split.tsv" >&2; exit 2; }
done
case "$opening" in
  ''|bm25_search|rm3_search) ;;
  hybrid_search) ((index_vectors)) || { echo "--opening-search hybrid_search needs --vectors or --hybrid-row" >&2; exit 2; } ;;
  *) echo "--opening-search $opening: one of bm25_search, rm3_search, hybrid_search" >&2; exit 2 ;;
esac
source="$(realpath "$source")"
# The run's reward, the metrics its table compares, and the metric that
# chooses the scripted baseline on validation (`score`: the reward's
# headline metric, nDCG@10 for rankings).
case "$task" in
  ranking) reward=ndcg@10 metrics=(ndcg@10) ;;
  answer) reward=answer+citations metrics=(answer_f1 citation_f1 answer+citations) ;;
  *) echo "--task $task: one of ranking, answer" >&2; exit 2 ;;
esac
work="$(realpath -m "${work:-$(mktemp -d -t sleuth-train-XXXXXX)}")"
mkdir -p "$work"
started=$(date +%s)
elapsed() { local s=$(( $(date +%s) - started )); printf '%d:%02d' $((s / 60)) $((s % 60)); }
# Whether the score $1 is above $2 (decimals, so not bash arithmetic).
above() {
  awk -v a="$1" -v b="$2" 'BEGIN {exit !(a > b)}'
}
say "working in $work (logs, checkpoints, evaluations)"

# The task sets (`sleuth data divide`): trajectory SFT and GRPO learn from
# disjoint halves of the train questions, and questions that share a judged
# document stay in one half. GRPO on the questions SFT learnt from rewarded
# recall (the SFT policy remembers their bridges) and taught nothing that
# holds on new questions; on questions it has not seen, a bridge pays only
# when it is copied from the results. Validation: the collection's own
# split, or a seventh of the train questions held out.
tasks="$work/tasks"
if [[ -f "$source/qrels/validation.tsv" ]]; then
  parts=(sft:1 rl:1)
else
  parts=(sft:3 rl:3 validation:1)
fi
"$bin/sleuth" data divide "$source" "$tasks" --from train --into "${parts[@]}"

say "[$(elapsed)] indexing $source as $collection"
index_flags=()
((index_vectors)) && index_flags+=(--vectors)
"$bin/tool-gateway" index --source "$source" --out "$work/index" --name "$collection" "${index_flags[@]}"

# The opening search: the search of the question a practitioner would try
# first, chosen by its nDCG@10 on the validation split (every judged
# validation question), so the agent starts from the best of them on this
# collection (BM25+RM3 suits some collections, hybrid others) and its turns
# only have to add to it.
if [[ -z "$opening" ]]; then
  candidates=(bm25 rm3)
  ((index_vectors)) && candidates+=(hybrid)
  best_opening_score=-1
  for method in "${candidates[@]}"; do
    score="$("$bin/tool-gateway" evaluate --index "$work/index" --source "$tasks" --split validation --method "$method" \
      | grep -o 'nDCG@10 [0-9.]*' | cut -d' ' -f2)"
    say "[$(elapsed)] ${method}_search of the question: validation nDCG@10 $score"
    [[ -n "$score" ]] || { say "tool-gateway evaluate --method $method printed no nDCG@10"; exit 1; }
    above "$score" "$best_opening_score" && opening="${method}_search" best_opening_score="$score"
  done
fi
say "the agent's opening search: $opening"
# What following leads can add to that search on this collection (which
# lead reaches each validation question's next judged document): near none
# on a one-hop collection, where the agent's best move is to submit at once.
"$bin/tool-gateway" leads --index "$work/index" --source "$tasks" --split validation --method "${opening%_search}" \
  | tee "$work/leads.txt"
# The agent's tools: BM25, the opening search, vector search with --vectors,
# follow_lead (search a lead the latest results list, by its number: a tiny
# policy chooses a number where it could not copy a name), and the answer
# tool. The fresh policy is pre-trained with exactly these in its prompt.
tools=bm25_search
[[ "$opening" != bm25_search ]] && tools+=",$opening"
((vectors)) && tools+=,vector_search
tools+=,follow_lead
[[ "$task" == answer ]] && tools+=,submit_answer

if [[ -z "$policy" ]]; then
  policy="$work/base"
  say "[$(elapsed)] making a fresh tiny policy for $collection ($copy_steps steps of copy pre-training)"
  "$bin/learner" init-policy --collection "$tasks" --split sft "$policy" --vocab-size 2048 --hidden-size 128 --layers 2 \
    --copy-steps "$copy_steps" --copy-batch 32 --copy-lr 3e-3 --tools "$tools"
fi
policy="$(realpath "$policy")"

mesh_init "$work"
# Nothing calls a run's learner (it calls the orchestrator), so it listens on
# a port the system picks: each run starts its own, and a fixed port lies in
# Linux's ephemeral range (32768-60999), where a connection made in the
# minute between two runs' learners can take it.
mesh_port[learner]=0
export SLEUTH_MODEL="$policy" SLEUTH_COLLECTIONS="$collection=$work/index" SLEUTH_ORCHESTRATOR="$orchestrator"
# The gateway may offer every search; each run's `agent.tools` says which its agent sees.
export SLEUTH_RM3_TOOL=true SLEUTH_HYBRID_TOOL=true
for name in rollout-orchestrator agent tool-gateway inference-gateway policy-server; do
  mesh_start "$name"
done
mesh_health

# Evaluates on the test split (extra flags: what to evaluate); remembers the
# evaluation as LABEL for the table. Nothing with --validation-only.
rows=()
evaluate() {
  local label="$1"
  shift
  ((validation_only)) && return 0
  say "[$(elapsed)] evaluating $label on the test split"
  "$bin/sleuth" eval --source "$tasks" --collection "$collection" --split test --limit "$eval_limit" "$@" \
    | tee "$work/eval-$label.txt"
  rows+=("$label=$(grep -o 'evaluation eval-[0-9a-f]*' "$work/eval-$label.txt" | cut -d' ' -f2)")
}

# Serves the model in DIR: the policy server restarts on it (a fresh
# version 0), so an evaluation scores exactly that model.
serve() {
  ((validation_only)) && return 0
  mesh_stop policy-server
  SLEUTH_MODEL="$1" mesh_start policy-server
  mesh_health >/dev/null
}

# Writes the spec of run $1, training on split $2 in groups of $3, with its
# own lines $4 (YAML).
spec() {
  cat >"$work/$1.yaml" <<SPEC
name: $1
train: {source_uri: $tasks, collection: $collection, split: $2, limit: $train_limit}
validation: {source_uri: $tasks, collection: $collection, split: validation, limit: $eval_limit}
group_size: $3
global_batch_size: 8
rollout_max_concurrency: 16
max_staleness: 1
reward: {name: $reward}
$4
SPEC
}

# Trains run $1: its learner starts first and waits for the run, then the
# run is created and followed to its end.
train() {
  say "[$(elapsed)] run $1: $(head -c -1 <<<"$2" | tr '\n' ' ')"
  SLEUTH_RUN_ID="$1" mesh_start learner
  local learner="${mesh_pid[learner]}" watch ended status
  local failed="the learner of run $1 failed (see $work/learner.log)"
  "$bin/sleuth" run create -f "$work/$1.yaml" --id "$1" --watch &
  watch=$!
  # A learner that dies (it cannot listen, cannot load its start model)
  # leaves its run waiting for steps forever: stop at once, naming its log.
  wait -n -p ended "$watch" "$learner" && status=0 || status=$?
  if [[ "$ended" == "$learner" ]]; then
    ((status == 0)) || { kill "$watch"; say "$failed"; exit 1; }
    wait "$watch"
  else
    ((status == 0)) || exit "$status"
    wait "$learner" || { say "$failed"; exit 1; }
  fi
  unset 'mesh_pid[learner]'
  "$bin/sleuth" run report "$1" --png "$work/$1.png" | tee "$work/$1.report"
}

# Answering in words, every SFT step also rehearses 48 conversations of copy
# pre-training (`training.copy_rehearsal`): without them SFT taught the
# policy to recall what it had read in the teacher's episodes instead of
# copying it (measured in docs/experiments/learner-recipe.md). Ranking, the
# policy copies nothing (the agent opens with the search of the question and
# leads are followed by number), and rehearsing drowned what SFT's episodes
# teach: which questions to bridge (chosen on validation, same document).
rehearsal=0
[[ "$task" == answer ]] && rehearsal=48
# Groups of 8: the teacher's mixture plays each question its 4 ways of at
# most one hop and 4 of its 9 two-hop ways (which bridge each hop follows;
# each epoch deals other two-hop ways) and SFT keeps the best (rejection
# sampling), so a group needs enough ways to hold the one that pays.
spec sft sft 8 "max_epochs: $sft_epochs
agent:
  budget: {max_turns: 5, max_new_tokens_per_turn: 96, max_episode_tokens: 6144, observation_char_cap: 2000}
  tools: [$tools]
  opening_search: $opening
  sampling: {seed: 1}
  teacher: $teacher
training: {learning_rate: 2.0e-3, lr_schedule: cosine, checkpoint_every: 10, eval_every: 10, sft_min_reward: 0.3, copy_rehearsal: $rehearsal}"
train sft "$(tail -n 8 "$work/sft.yaml")"

# Baselines a practitioner would try first: one search of the question
# (BM25, BM25 with RM3 pseudo-relevance feedback, hybrid), and the scripted
# multi-hop search: the teacher's fixed strategy (bm25:0, 1 or 2 hops) that
# scores best on the validation split, then evaluated once on test.
# Every policy row runs with the SFT run's agent settings, greedy.
if [[ "$task" == ranking ]]; then
  evaluate bm25 --contender bm25
  evaluate rm3 --contender rm3
  ((index_vectors)) && evaluate hybrid --contender hybrid
fi
best_strategy="" best_score=-1
for strategy in bm25:0 bm25:1 bm25:2; do
  say "[$(elapsed)] scripted $strategy on the validation split"
  score="$("$bin/sleuth" eval --source "$tasks" --collection "$collection" --split validation --limit "$eval_limit" \
    --teacher "$strategy" --agent-from sft | awk '$1 == "score" {print $2}')"
  say "scripted $strategy: validation score (${metrics[0]}) ${score:-none}"
  [[ -n "$score" ]] && above "$score" "$best_score" && best_strategy="$strategy" best_score="$score"
done
[[ -n "$best_strategy" ]] || { say "no scripted strategy was scored on validation"; exit 1; }
say "scripted baseline: $best_strategy (validation score $best_score)"
evaluate scripted --teacher "$best_strategy" --agent-from sft
evaluate teacher --teacher "$teacher" --agent-from sft
serve "$policy"
evaluate base --agent-from sft
sft="$("$bin/learner" best-policy sft)"
serve "$sft"
evaluate sft --agent-from sft

# GRPO on the other half of the train questions, one run per --grpo
# setting (learning rate : KL coefficient to the SFT policy : sampling
# temperature), chosen between on validation. Groups of 8. The default
# learning rate, 3e-4, was chosen on the validation split of one collection
# of each generator family, seeds no reported run uses (companies 4711,
# services 5813; docs/experiments/learner-recipe.md): its best validated
# version scored at least 1e-4's on both (+0.035, +0.001), while 1e-4 was
# still moving when its runs ended and 1e-3 broke within five steps. The KL
# term (1.0) and the temperature (0.7) were not varied on both families.
grpo_spec() {
  spec "$1" rl 8 "max_epochs: $grpo_epochs
policy: {from_run: sft}
agent:
  budget: {max_turns: 5, max_new_tokens_per_turn: 96, max_episode_tokens: 6144, observation_char_cap: 2000}
  tools: [$tools]
  opening_search: $opening
  sampling: {temperature: $4, seed: 2}
training: {advantage: grpo, loss: ppo, learning_rate: $2, kl_coef: $3, checkpoint_every: 5, eval_every: 5}"
}

# The validation score of run $1's best version (the line its report,
# kept by `train`, marks).
best_validation() {
  awk '/ \*$/ {print $6}' "$work/$1.report"
}

# The evaluation id of run $1's best version's validation.
best_validation_id() {
  echo "$1-validation-v$(awk '/best version by validation score:/ {print $NF}' "$work/$1.report")"
}

sft_score="$(best_validation sft)"
say "sft: best validation score ${sft_score:-none}"
chosen="" chosen_score=-1
for i in "${!grpo_runs[@]}"; do
  run=grpo
  ((${#grpo_runs[@]} > 1)) && run="grpo-$((i + 1))"
  IFS=: read -r rate kl temperature <<<"${grpo_runs[$i]}"
  grpo_spec "$run" "$rate" "$kl" "$temperature"
  train "$run" "$(tail -n 7 "$work/$run.yaml")"
  score="$(best_validation "$run")"
  say "$run (learning rate:kl:temperature ${grpo_runs[$i]}): best validation score ${score:-none} (sft ${sft_score:-none})"
  [[ -n "$score" ]] && above "$score" "$chosen_score" && chosen="$run" chosen_score="$score"
done
[[ -n "$chosen" ]] || { say "no GRPO run was validated"; exit 1; }
say "GRPO chosen on validation: $chosen (score $chosen_score)"
# Question by question on the validation split: GRPO's best version against
# SFT's, with the paired interval (a gain inside the noise shows as such).
"$bin/sleuth" compare --metric score --against sft "sft=$(best_validation_id sft)" \
  "$chosen=$(best_validation_id "$chosen")" | tee "$work/validation-table.txt"
if ((validation_only)); then
  say "done in $(elapsed) (--validation-only: nothing evaluated on the test split)"
  exit 0
fi
grpo="$("$bin/learner" best-policy "$chosen")"
serve "$grpo"
evaluate grpo --agent-from sft

say "[$(elapsed)] test split of $collection: each row against SFT, paired by question"
: >"$work/table.txt"
for metric in "${metrics[@]}"; do
  "$bin/sleuth" compare --metric "$metric" --against sft "${rows[@]}" | tee -a "$work/table.txt"
done
# Against the best baseline chosen on validation: the scripted search (its
# 0 hops is the opening search, itself the best single search of the
# question on validation).
say "test split of $collection: each row against the scripted $best_strategy, paired by question"
"$bin/sleuth" compare --metric "${metrics[0]}" --against scripted "${rows[@]}" | tee -a "$work/table.txt"
say "learning curves: $work/sft.png, $work/$chosen.png; the table: $work/table.txt"
say "SFT policy: $sft"
say "GRPO policy: $grpo"
for name in rollout-orchestrator agent tool-gateway inference-gateway policy-server; do
  mesh_stop "$name" >/dev/null
done
say "done in $(elapsed)"
