#!/usr/bin/env bash
# Where the consumer's statements spend their time: the same batches of 16 one-step probe jobs
# claimed, stepped and ended three ways, with pgbench, on a copy of the probe tables.
#
#   two     the engine's own statements: the batched claim committed, then one transaction
#           with the group fence, the step and the end (2 job and 2 outbox row versions a job)
#   one-tx  the same three statements in a single transaction (no fence), to see what the
#           commit in between costs
#   fused   the job and outbox rows locked, the step, and one statement that writes the
#           claim's and the end's columns together (1 job and 1 outbox row version a job);
#           the committed rows are the same, the `running`/`leased` states never commit
#
# The statements in row-versions/ are the engine's as it renders them for the probe kind
# (claim.sql, fence.sql, step.sql, end.sql), with their parameters written out; they do not
# follow later changes to the engine's SQL by themselves.
#
# The database comes from the bench's statements scenario, kept:
#   KFS_BENCH_KEEP_DB=1 DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \
#     target/release/kfs-worker bench --jobs 20000 --scenarios statements
#   ops/pgbench/row-versions.sh kfs_bench_statements_<tag> [rounds]
# Each run puts every job back to `queued` (outbox `dispatched`), then 4 pgbench clients take
# 1,248 batches; CPU per job is the whole machine's busy time (/proc/stat) over the run.
set -euo pipefail
db=${1:?usage: row-versions.sh DATABASE [ROUNDS]}
rounds=${2:-2}
here=$(cd "$(dirname "$0")/row-versions" && pwd)
psql=(psql -X -q -h "${PGHOST:-127.0.0.1}" -U "${PGUSER:-postgres}" -d "$db")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

take() { printf 'BEGIN;\n'; cat "$here/take.sql"; printf 'COMMIT;\n'; }
{ take; printf 'BEGIN;\n'; cat "$here/claim.sql"; printf 'COMMIT;\nBEGIN;\n'
  cat "$here/fence.sql" "$here/step.sql" "$here/end.sql"; printf 'COMMIT;\n'; } > "$work/two.sql"
{ take; printf 'BEGIN;\n'; cat "$here/claim.sql" "$here/step.sql" "$here/end.sql"; printf 'COMMIT;\n'; } > "$work/one-tx.sql"
{ take; printf 'BEGIN;\n'; cat "$here/lock.sql" "$here/step.sql" "$here/end-fused.sql"; printf 'COMMIT;\n'; } > "$work/fused.sql"

busy() { awk '/^cpu /{print $2+$3+$4+$7+$8}' /proc/stat; }
hz=$(getconf CLK_TCK)
run() {
  local variant=$1
  if ! "${psql[@]}" -v ON_ERROR_STOP=1 -f "$here/reset.sql" > "$work/reset.log" 2>&1; then
    echo "row-versions: cannot reset $db (is it a kept statements-scenario database?):" >&2
    grep -m1 ERROR "$work/reset.log" >&2 || tail -1 "$work/reset.log" >&2
    exit 1
  fi
  local b0 t0 b1 t1 jobs effects
  b0=$(busy); t0=$(date +%s.%N)
  if ! pgbench -h "${PGHOST:-127.0.0.1}" -U "${PGUSER:-postgres}" -n -c 4 -j 2 -t 312 \
      -f "$work/$variant.sql" "$db" > "$work/$variant.log" 2>&1; then
    echo "row-versions: pgbench failed for $variant:" >&2; tail -3 "$work/$variant.log" >&2; exit 1
  fi
  t1=$(date +%s.%N); b1=$(busy)
  jobs=$("${psql[@]}" -Atc "SELECT count(*) FROM kfs_probe_jobs WHERE run_state = 'succeeded' AND row_version = 4")
  effects=$("${psql[@]}" -Atc "SELECT count(*) FROM kfs_probe_effects")
  if [ "$jobs" != "$effects" ] || [ "$jobs" = 0 ]; then
    echo "row-versions: $variant ended $jobs jobs with $effects effects" >&2; exit 1
  fi
  awk -v v="$variant" -v j="$jobs" -v t0="$t0" -v t1="$t1" -v b="$((b1 - b0))" -v hz="$hz" \
    'BEGIN { w = t1 - t0; printf "%-7s %6d jobs  %5.2f s  %6.0f jobs/s  %.3f ms of the machine a job\n", v, j, w, j / w, b * 1000 / hz / j }'
}
for ((r = 1; r <= rounds; r++)); do
  for v in two one-tx fused; do run "$v"; done
done
