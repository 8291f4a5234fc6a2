#!/usr/bin/env bash
# Runs the fault, restart and resume tests many times, first on an idle
# machine, then with a CPU hog on every core beside them, and reports how many
# runs of each test passed. Races that one run of `make test` misses (a reader
# between two writes, a restart before a write) show up here as a count below
# the number of runs. Not part of `make test`: it takes hours at 20 runs.
#
#   STRESS_RUNS   runs of each test per mode (default 20)
#   STRESS_MODES  which modes, in order (default "idle loaded")
#   STRESS_LOGS   where each run's log goes (default a new temporary folder)
set -euo pipefail

runs="${STRESS_RUNS:-20}"
modes="${STRESS_MODES:-idle loaded}"
logs="${STRESS_LOGS:-$(mktemp -d -t sleuth-stress.XXXXXX)}"
mkdir -p "$logs"

# The tests that kill, restart or resume a service, or hold one at a pause
# point while another ends (nextest filter expressions).
tests=(
  'package(rollout-orchestrator) & test(=a_run_read_as_it_fails_never_shows_the_failure_without_its_reason)'
  'package(rollout-orchestrator) & test(=a_restarted_orchestrator_reports_a_finished_runs_progress)'
  'package(sleuth-tests) & test(=a_failed_run_resumes_where_it_stopped)'
  'package(sleuth-tests) & test(=runs_survive_a_dead_worker_and_an_orchestrator_restart)'
  'package(sleuth-tests) & test(=a_training_run_closes_the_loop_through_faults)'
  'package(sleuth-tests) & test(=a_cancelled_runs_learner_trains_what_was_published_and_exits)'
  'package(learner) & test(=a_killed_learner_resumes_to_the_uninterrupted_result)'
  'package(inference-gateway) & test(=turns_are_recorded_token_for_token_and_survive_a_restart)'
  'package(inference-gateway) & test(=episodes_stick_to_a_replica_and_fail_over_when_it_dies)'
  'package(inference-gateway) & test(=a_replica_whose_scheduler_dies_stops_serving_and_its_episodes_move)'
)
filter="$(printf '(%s) | ' "${tests[@]}")"
filter="${filter% | }"

say() { printf '\033[1mstress:\033[0m %s\n' "$*"; }

hogs=()
stop_hogs() {
  if [ ${#hogs[@]} -gt 0 ]; then kill "${hogs[@]}" 2>/dev/null || true; fi
  hogs=()
}
trap stop_hogs EXIT

# Build once, before any clock starts.
cargo nextest run --workspace --profile stress -E "$filter" --no-run

declare -A passed failed
incomplete=0
# The report: every test that ran, per mode, passed runs out of the runs
# made. Also printed when the stress is stopped early (Ctrl-C, kill), so a
# partial stress still says what it saw.
report() {
  local bad=0 key ok total
  printf '%-10s %-8s %s\n' mode passed test
  for key in $(printf '%s\n' "${!passed[@]}" "${!failed[@]}" | sort -u | tr ' ' '|'); do
    key="${key//|/ }"
    ok=${passed[$key]:-0}
    total=$((ok + ${failed[$key]:-0}))
    [ "$ok" = "$runs" ] && [ "$total" = "$runs" ] || bad=1
    printf '%-10s %-8s %s\n' "${key%% *}" "$ok/$total" "${key#* }"
  done
  [ ${#passed[@]} -gt 0 ] || { echo "stress: no test ran; see $logs" >&2; return 1; }
  [ "$bad" = 0 ] && [ "$incomplete" = 0 ] || { echo "stress: not every run of $runs passed; logs in $logs" >&2; return 1; }
  say "every run passed; logs in $logs"
}
trap 'stop_hogs; echo; say "stopped early"; report; exit 130' INT TERM

for mode in $modes; do
  case "$mode" in
    idle) ;;
    loaded)
      # One busy loop per core, at the tests' own priority.
      for _ in $(seq "$(nproc)"); do
        bash -c 'while :; do :; done' &
        hogs+=($!)
      done
      ;;
    *) echo "stress: STRESS_MODES: unknown mode $mode (idle, loaded)" >&2; exit 2 ;;
  esac
  for run in $(seq "$runs"); do
    log="$logs/$mode-$run.log"
    started=$SECONDS
    cargo nextest run --workspace --profile stress -E "$filter" --status-level pass >"$log" 2>&1 || true
    seen=0
    # One line per test and outcome: "PASS [ 5.6s] crate::binary test".
    while read -r outcome name; do
      key="$mode $name"
      if [ "$outcome" = PASS ]; then
        passed[$key]=$((${passed[$key]:-0} + 1))
      else
        failed[$key]=$((${failed[$key]:-0} + 1))
      fi
      seen=$((seen + 1))
    # Up to the summary, which repeats the failures.
    done < <(sed -E 's/\x1b\[[0-9;]*m//g' "$log" | sed -E '/^ *Summary \[/q' |
      sed -nE 's/^ *(PASS|FAIL|TIMEOUT|SIGSEGV|SIGABRT|SIGKILL|ABORT) +\[[^]]*\] +(\([^)]*\) +)?([^ ]+ [^ ]+)$/\1 \3/p')
    if [ "$seen" != "${#tests[@]}" ]; then
      say "$mode run $run/$runs: $seen of ${#tests[@]} tests reported an outcome (log $log)"
      incomplete=1
    fi
    say "$mode run $run/$runs done in $((SECONDS - started)) s (log $log)"
  done
  stop_hogs
done

report
