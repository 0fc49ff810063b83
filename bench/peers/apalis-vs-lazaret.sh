#!/usr/bin/env bash
# lazaret against apalis 1.0 (apalis-postgres) on the same PostgreSQL, interleaved.
#
# Builds `lazaret` (release, workspace target dir) and the apalis peer
# (bench/peers/apalis, release, its own target dir), then runs R rounds of
#   lazaret bench --store $PG --jobs N --batch 100 --backlog B --config wide.toml
#   apalis peer --mode drain       (N queued first, then the workers drain them)
#   apalis peer --mode concurrent  (8 producers push while the workers run, as lazaret's bench does)
# alternating which side goes first, and prints each run, the medians, the
# spread and the ratios. `uptime` is recorded before and after every run.
#
# Environment: PG (postgres://postgres@127.0.0.1:5432/test), ROUNDS (3),
# JOBS (50000), BACKLOG (20000), LAZARET_TARGET (/work/tgt-shared),
# APALIS_TARGET (/work/tgt-apalis), APALIS_ARGS (extra peer options),
# NO_BUILD=1 to use the binaries already built.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
PG=${PG:-postgres://postgres@127.0.0.1:5432/test}
ROUNDS=${ROUNDS:-3}
JOBS=${JOBS:-50000}
BACKLOG=${BACKLOG:-20000}
LAZARET_TARGET=${LAZARET_TARGET:-/work/tgt-shared}
APALIS_TARGET=${APALIS_TARGET:-/work/tgt-apalis}
APALIS_ARGS=${APALIS_ARGS:-}

if [ -z "${NO_BUILD:-}" ]; then
    (cd "$root" && CARGO_TARGET_DIR=$LAZARET_TARGET cargo build --release -p lazaret)
    (cd "$here/apalis" && CARGO_TARGET_DIR=$APALIS_TARGET cargo build --release --locked)
fi
work=$(mktemp -d /tmp/apalis-vs-lazaret.XXXXXX)
trap 'rm -rf "$work"' EXIT
# Copies, so that another build into the shared target dir cannot swap a
# binary between rounds (bench starts its servers from its own executable).
cp "$LAZARET_TARGET/release/lazaret" "$work/lazaret"
cp "$APALIS_TARGET/release/apalis-peer-bench" "$work/apalis-peer-bench"
lazaret=$work/lazaret
peer=$work/apalis-peer-bench
echo "lazaret $(cd "$root" && git rev-parse --short HEAD), $("$lazaret" --version 2>/dev/null || true)" >&2
printf '[tenants]\ninflight_max = 1000\n' > "$work/wide.toml"
results=$work/results.tsv
: > "$results"

load1() { cut -d' ' -f1 /proc/loadavg; }

# run NAME CMD...: runs CMD (one JSON object on stdout), appends
# "name jobs_per_s load_before load_after" to the results.
run() {
    local name=$1; shift
    local before after out
    before=$(load1)
    echo "== $name  ($(uptime))" >&2
    out=$("$@" 2>"$work/stderr") || { cat "$work/stderr" >&2; echo "$name failed" >&2; exit 1; }
    after=$(load1)
    echo "$out" > "$work/last.json"
    local jps
    jps=$(python3 -c 'import json,sys; print(round(json.load(open(sys.argv[1]))["jobs_per_s"]))' "$work/last.json")
    echo "   $name: $jps jobs/s (load $before -> $after)" >&2
    echo "   $out" >&2
    printf '%s\t%s\t%s\t%s\n' "$name" "$jps" "$before" "$after" >> "$results"
}

lazaret_run() {
    run lazaret "$lazaret" --json bench --store "$PG" --jobs "$JOBS" --batch 100 \
        --backlog "$BACKLOG" --config "$work/wide.toml"
}
apalis_run() {
    # shellcheck disable=SC2086 # APALIS_ARGS is a list of options
    run "apalis-$1" "$peer" --url "$PG" --jobs "$JOBS" --backlog "$BACKLOG" --mode "$1" $APALIS_ARGS
}

echo "start: $(uptime)" >&2
for r in $(seq 1 "$ROUNDS"); do
    if [ $((r % 2)) -eq 1 ]; then
        lazaret_run; apalis_run drain; apalis_run concurrent
    else
        apalis_run concurrent; apalis_run drain; lazaret_run
    fi
done
echo "end: $(uptime)" >&2

python3 - "$results" <<'EOF'
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
by = {}
for name, jps, before, after in rows:
    by.setdefault(name, []).append((int(jps), float(before), float(after)))
med = {}
print(f"{'side':<20} {'jobs/s per run':<28} {'median':>8}  load (1 min) before/after")
for name in ("lazaret", "apalis-drain", "apalis-concurrent"):
    runs = by.get(name, [])
    if not runs:
        continue
    med[name] = statistics.median(j for j, _, _ in runs)
    print(f"{name:<20} {' · '.join(str(j) for j, _, _ in runs):<28} {med[name]:>8.0f}  "
          + ", ".join(f"{b:.1f}/{a:.1f}" for _, b, a in runs))
for peer in ("apalis-drain", "apalis-concurrent"):
    if "lazaret" in med and peer in med:
        print(f"lazaret / {peer}: x{med['lazaret'] / med[peer]:.2f}")
EOF
