#!/usr/bin/env bash
# Operators' clusters (issue 39): scanforest's matching on an external Dask cluster started from
# the shell, and the same match again while one worker is killed (SIGKILL) mid-match; the two
# runs' stored matches must be identical.
#
#   bash deploy/recipes/external-cluster.sh [WORKDIR]
#
# What it does, in the order an operator would do it by hand:
#   1. `dask scheduler --host $HOST --port $PORT --no-dashboard`
#   2. one worker process per GPU on a GPU host (`CUDA_VISIBLE_DEVICES=i dask cuda worker ADDR
#      --nthreads $THREADS --name wI`), or $WORKERS `dask worker ADDR --nworkers 1 --nthreads
#      $THREADS --name wI` on a CPU host: each worker its own command, so that its pid is known
#   3. a synthetic archive (models + scenes, scanforest.tasks.synth.write_archive), then
#      `scanforest ingest ... --scheduler ADDR`, `scanforest describe ... --scheduler ADDR` and
#      `scanforest index build -r 'models__*' --shards $WORKERS` (a shard per worker)
#   4. the described store copied twice (cp -a): run A `scanforest match A --scheduler ADDR`,
#      undisturbed; run B `scanforest match B --scheduler ADDR` while a watcher SIGKILLs worker
#      $VICTIM as soon as $KILL_AFTER scan(s) of B have their matches written
#   5. every query scan's stored match_ids and match_dist compared bit for bit between A and B
#
# Exit 0 with a PASS line (scans matched, each run's seconds, which worker was killed and when);
# 1 when the stored matches differ (the differing scans are listed), a run failed, or the kill
# did not land during run B's matching; 2 for bad inputs (no `dask`, no UCX for PROTOCOL=ucx, ...).
#
# "Killed" here is the realistic fault: the worker PROCESS (the one holding shards and query
# blocks, as the OOM killer or a crash would take it) is SIGKILLed, under the Nanny that
# `dask worker` / `dask cuda worker` run by default; the Nanny starts a fresh worker, which holds
# nothing. NANNY=0 starts the workers with `--no-nanny` (dask worker only): the killed worker is
# then gone for good and the run finishes on the others.
#
# Knobs (environment):
#   SF=scanforest       the CLI (a command line, e.g. "python3 -m scanforest.deploy.cli")
#   DASK=dask           the Dask CLI (same environment as scanforest: its workers run its tasks)
#   PYTHON              the Python of SF (default: taken from SF's script; used for the archive,
#                       the waits and the comparison)
#   DEVICE=auto         auto | cpu | gpu (auto: GPU workers when `nvidia-smi -L` lists GPUs)
#   WORKERS             worker processes (default: one per visible GPU, at least 2; on CPU 2);
#                       more workers than GPUs share them round-robin
#   THREADS             threads per worker (default 2 on GPU workers, as deploy/README.md
#                       advises for matching; 1 on CPU)
#   PROTOCOL=tcp        tcp | ucx (ucx needs distributed-ucxx and ucxx in the workers' Python)
#   SCANS, POINTS       synthetic scenes and points per scene (default 12 x 8000 on CPU,
#                       64 x 40000 on GPU)
#   MODELS=2            synthetic models (the index's reference); MODEL_POINTS=3000
#   KEYPOINT_RADIUS=0.03 SHOT_RADIUS=0.04   describe's settings
#   VICTIM=w<WORKERS-1>  the worker killed in run B
#   KILL_AFTER=1        kill once this many scans of run B have their matches written
#   NANNY=1             0: workers without a Nanny (see above)
#   HOST=127.0.0.1 PORT (default: a free one)   where the scheduler listens
#   WORKER_ARGS         extra arguments for every worker (e.g. "--rmm-pool-size 0.8")
#   RUN_TIMEOUT=900     seconds any one scanforest command may take (a hung run fails the recipe)
#   WAIT=120            seconds to wait for the workers (and the Prefect API) to be up
#   PREFECT_API_URL     a Prefect server for the runs' records; unset: the recipe starts one,
#                       `prefect server start --no-ui --no-services` with PREFECT_HOME in WORKDIR
#                       (as an operator's cluster has one), so that each command does not start
#                       its own temporary API (about 10 s a command on 2 cores)
set -euo pipefail

if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 0
fi

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)  # compare_matches.py lies beside this script
die() { echo "external-cluster: $*" >&2; exit 2; }  # bad input: one line, exit 2
say() { echo "== $*"; }
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

# ------------------------------------------------------------------------------ the tools
read -r -a SF_CMD <<< "${SF:-scanforest}"
read -r -a DASK_CMD <<< "${DASK:-dask}"
[[ ${#SF_CMD[@]} -gt 0 ]] || die "SF is empty"
[[ ${#DASK_CMD[@]} -gt 0 ]] || die "DASK is empty"
command -v "${DASK_CMD[0]}" >/dev/null 2>&1 || die "no '${DASK_CMD[0]}' on PATH: install dask and distributed in scanforest's environment (or set DASK)"
command -v setsid >/dev/null 2>&1 || die "no 'setsid' on PATH (util-linux): the recipe starts each process in its own group"
command -v "${SF_CMD[0]}" >/dev/null 2>&1 || die "no '${SF_CMD[0]}' on PATH: install scanforest (or set SF)"

# the Python interpreter behind a command: itself when it is one, else its script's #! line
python_of() {
  local p line words
  p=$(command -v "$1" 2>/dev/null) || return 1
  case "$(basename "$p")" in python*) echo "$p"; return 0 ;; esac
  line=$(head -n 1 "$p" 2>/dev/null) || return 1
  [[ "$line" == '#!'* ]] || return 1
  read -r -a words <<< "${line#\#!}"
  [[ ${#words[@]} -gt 0 ]] || return 1
  if [[ "${words[0]}" == */env ]]; then
    [[ ${#words[@]} -gt 1 ]] || return 1
    command -v "${words[1]}"
  else
    echo "${words[0]}"
  fi
}
PY=${PYTHON:-$(python_of "${SF_CMD[0]}" || command -v python3 || true)}
[[ -n "$PY" ]] || die "cannot tell the Python of '${SF_CMD[*]}': set PYTHON"
"$PY" -c 'import scanforest, distributed' 2>/dev/null || die "$PY cannot import scanforest and distributed: set PYTHON to scanforest's Python"
DASK_PY=$(python_of "${DASK_CMD[0]}" || true)
if [[ -n "$DASK_PY" && "$DASK_PY" != "$PY" ]] && ! "$DASK_PY" -c 'import scanforest' 2>/dev/null; then
  die "'${DASK_CMD[*]}' runs $DASK_PY, which cannot import scanforest: its workers could not run scanforest's tasks (install both in one environment, or set DASK)"
fi
WPY=${DASK_PY:-$PY}  # the workers' Python

# ------------------------------------------------------------------------------ the settings
PROTOCOL=${PROTOCOL:-tcp}
DEVICE=${DEVICE:-auto}
NANNY=${NANNY:-1}
HOST=${HOST:-127.0.0.1}
WAIT=${WAIT:-120}
KILL_AFTER=${KILL_AFTER:-1}
RUN_TIMEOUT=${RUN_TIMEOUT:-900}
MODELS=${MODELS:-2}
MODEL_POINTS=${MODEL_POINTS:-3000}
KEYPOINT_RADIUS=${KEYPOINT_RADIUS:-0.03}
SHOT_RADIUS=${SHOT_RADIUS:-0.04}
case "$PROTOCOL" in
  tcp) PROTO_ARGS=() ;;
  ucx)
    "$WPY" -c 'import distributed_ucxx, ucxx' 2>/dev/null \
      || die "PROTOCOL=ucx, but $WPY cannot import distributed_ucxx and ucxx (pip install distributed-ucxx-cu12, or PROTOCOL=tcp)"
    PROTO_ARGS=(--protocol ucx) ;;
  *) die "PROTOCOL must be tcp or ucx, got '$PROTOCOL'" ;;
esac
case "$DEVICE" in auto | cpu | gpu) ;; *) die "DEVICE must be auto, cpu or gpu, got '$DEVICE'" ;; esac
[[ "$NANNY" == 0 || "$NANNY" == 1 ]] || die "NANNY must be 0 or 1, got '$NANNY'"

GPUS=()  # the GPU ids the workers are given, one per worker in turn
if [[ "$DEVICE" != cpu ]] && command -v nvidia-smi >/dev/null 2>&1; then
  n_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  if [[ "${n_gpus:-0}" -gt 0 && -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
    IFS=, read -r -a GPUS <<< "$CUDA_VISIBLE_DEVICES"  # the GPUs this shell may use
  elif [[ "${n_gpus:-0}" -gt 0 ]]; then
    mapfile -t GPUS < <(seq 0 $((n_gpus - 1)))
  fi
fi
if [[ "$DEVICE" == gpu && ${#GPUS[@]} -eq 0 ]]; then die "DEVICE=gpu, but nvidia-smi lists no GPU"; fi
if [[ ${#GPUS[@]} -gt 0 ]]; then
  KIND=gpu
  WORKERS=${WORKERS:-$(( ${#GPUS[@]} > 2 ? ${#GPUS[@]} : 2 ))}
  THREADS=${THREADS:-2}
  SCANS=${SCANS:-64}
  POINTS=${POINTS:-40000}
  if "$WPY" -c 'import dask_cuda' 2>/dev/null; then
    WORKER_CMD=("${DASK_CMD[@]}" cuda worker)
  else
    echo "note: dask-cuda is not installed: GPU workers are plain 'dask worker' processes, one CUDA_VISIBLE_DEVICES each"
    WORKER_CMD=("${DASK_CMD[@]}" worker --nworkers 1)
  fi
  if [[ "$NANNY" == 0 ]]; then die "NANNY=0 is for CPU workers: dask cuda worker always runs a Nanny"; fi
else
  KIND=cpu
  DEVICE=cpu
  WORKERS=${WORKERS:-2}
  THREADS=${THREADS:-1}
  SCANS=${SCANS:-12}
  POINTS=${POINTS:-8000}
  WORKER_CMD=("${DASK_CMD[@]}" worker --nworkers 1)
fi
for v in WORKERS THREADS SCANS POINTS KILL_AFTER WAIT RUN_TIMEOUT MODELS MODEL_POINTS; do
  [[ "${!v}" =~ ^[0-9]+$ && "${!v}" -ge 1 ]] || die "$v must be a positive whole number, got '${!v}'"
done
[[ "$WORKERS" -ge 2 ]] || die "WORKERS must be at least 2 (one of them is killed), got $WORKERS"
[[ "$KILL_AFTER" -lt "$SCANS" ]] || die "KILL_AFTER ($KILL_AFTER) must be below SCANS ($SCANS): the kill must land mid-match"
VICTIM=${VICTIM:-w$((WORKERS - 1))}
[[ "$VICTIM" =~ ^w[0-9]+$ && "${VICTIM#w}" -lt "$WORKERS" ]] || die "VICTIM must be one of w0..w$((WORKERS - 1)), got '$VICTIM'"
read -r -a EXTRA <<< "${WORKER_ARGS:-}"
NANNY_ARGS=()
if [[ "$NANNY" == 0 ]]; then NANNY_ARGS=(--no-nanny); fi

# ------------------------------------------------------------------------------ the folder
MARK=.scanforest-external-cluster
if [[ $# -ge 1 ]]; then
  WORK=$1
  mkdir -p "$WORK" || die "cannot create the folder $WORK"
  WORK=$(cd "$WORK" && pwd)
  if [[ -n "$(ls -A "$WORK")" ]]; then
    [[ -e "$WORK/$MARK" ]] || die "$WORK is not empty and not a folder of this recipe: give an empty or new folder"
    # an earlier run of this recipe: start afresh (its Prefect database is kept: a migrated one
    # starts in about 6 s instead of 14 on 2 cores)
    find "$WORK" -mindepth 1 -maxdepth 1 ! -name prefect -exec rm -rf {} +
  fi
else
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/scanforest-external-cluster.XXXXXX")
fi
touch "$WORK/$MARK"
LOGS=$WORK/logs
mkdir -p "$LOGS"
STORE=$WORK/store.zarr A=$WORK/a.zarr B=$WORK/b.zarr

# ------------------------------------------------------------------------------ cleanup
# process groups this script started (setsid): the scheduler, the workers, the Prefect server and
# run B; they are stopped however the script ends (TERM, then KILL after 5 s). Were the script
# itself SIGKILLed, the workers would still leave 60 s after the scheduler (--death-timeout 60).
GROUPS_STARTED=()
cleanup() {
  local rc=$? g
  trap - EXIT INT TERM
  for g in "${GROUPS_STARTED[@]}"; do kill -TERM -- "-$g" 2>/dev/null || true; done
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    local alive=0
    for g in "${GROUPS_STARTED[@]}"; do kill -0 -- "-$g" 2>/dev/null && alive=1; done
    [[ $alive == 0 ]] && break
    sleep 0.5
  done
  for g in "${GROUPS_STARTED[@]}"; do kill -KILL -- "-$g" 2>/dev/null || true; done
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# start "$@" as its own process group (so its children go with it), output to log $1
start() {
  local log=$1
  shift
  setsid "$@" >"$log" 2>&1 </dev/null &
  GROUPS_STARTED+=("$!")
  disown "$!"  # no "Killed" job notice from bash when the victim (without a Nanny) dies
}

# ------------------------------------------------------------------------------ 1-2. the cluster
PORT=${PORT:-$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
ADDR="$PROTOCOL://$HOST:$PORT"
T_START=$(now)
say "work folder: $WORK"
say "scheduler: ${DASK_CMD[*]} scheduler --host $HOST --port $PORT --no-dashboard ${PROTO_ARGS[*]}"
start "$LOGS/scheduler.log" "${DASK_CMD[@]}" scheduler --host "$HOST" --port "$PORT" --no-dashboard "${PROTO_ARGS[@]}"

# the Prefect API the runs report to (an operator's long-lived server; here one for this recipe)
if [[ -z "${PREFECT_API_URL:-}" ]]; then
  PF_PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  export PREFECT_HOME=$WORK/prefect PREFECT_SERVER_ANALYTICS_ENABLED=false
  export PREFECT_API_URL="http://127.0.0.1:$PF_PORT/api"
  say "prefect: $PY -m prefect server start --host 127.0.0.1 --port $PF_PORT --no-ui --no-services (PREFECT_HOME=$PREFECT_HOME)"
  start "$LOGS/prefect.log" "$PY" -m prefect server start --host 127.0.0.1 --port "$PF_PORT" --no-ui --no-services
else
  say "prefect: the server at PREFECT_API_URL=$PREFECT_API_URL"
fi

# CPU workers share the host's cores: numba's threads likewise (as scanforest's own local cluster does)
cores=$(nproc 2>/dev/null || echo 1)
NUMBA_THREADS=${NUMBA_NUM_THREADS:-$(( cores / (WORKERS * THREADS) > 1 ? cores / (WORKERS * THREADS) : 1 ))}
for ((i = 0; i < WORKERS; i++)); do
  env_args=(NUMBA_NUM_THREADS="$NUMBA_THREADS")
  if [[ $KIND == gpu ]]; then env_args+=(CUDA_VISIBLE_DEVICES="${GPUS[i % ${#GPUS[@]}]}"); fi
  args=("${WORKER_CMD[@]}" "$ADDR" --nthreads "$THREADS" --name "w$i" --no-dashboard --death-timeout 60
        "${NANNY_ARGS[@]}" "${PROTO_ARGS[@]}" "${EXTRA[@]}")
  say "worker w$i: ${env_args[*]} ${args[*]}"
  start "$LOGS/w$i.log" env "${env_args[@]}" "${args[@]}"
done

# the synthetic archive is written while the cluster starts
say "synthetic archive: $MODELS models of $MODEL_POINTS points, $SCANS scenes of $POINTS points"
"$PY" -c 'import sys
from scanforest.tasks.synth import write_archive
write_archive(sys.argv[1], n_models=int(sys.argv[2]), n_scenes=int(sys.argv[3]), points_per_scene=int(sys.argv[4]),
              points_per_model=int(sys.argv[5]), n_instances=2)' \
  "$WORK/archive" "$MODELS" "$SCANS" "$POINTS" "$MODEL_POINTS" >"$LOGS/archive.log" 2>&1 &
ARCHIVE_PID=$!

# wait until the scheduler sees every worker; note each worker's pid (the process a kill takes);
# then until the Prefect API answers
if ! "$PY" - "$ADDR" "$WORKERS" "$WAIT" "$PREFECT_API_URL" >"$WORK/workers.txt" 2>"$LOGS/wait.log" <<'EOF'
import os, sys, time, urllib.request
from distributed import Client
addr, n, wait, api = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
t0 = time.monotonic()
with Client(addr, timeout=f"{wait}s") as c:
    c.wait_for_workers(n, timeout=wait)
    names = {a: w["name"] for a, w in c.scheduler_info(n_workers=-1)["workers"].items()}
    for a, pid in sorted(c.run(os.getpid).items(), key=lambda x: str(names[x[0]])):
        print(names[a], pid, a)
print(f"workers up after {time.monotonic() - t0:.1f} s", file=sys.stderr)
while True:
    try:
        with urllib.request.urlopen(api.rstrip("/") + "/health", timeout=2) as r:
            if r.status == 200:
                break
    except OSError:
        pass
    if time.monotonic() > t0 + wait:
        sys.exit(f"the Prefect API at {api} did not answer within {wait:.0f} s")
    time.sleep(0.2)
EOF
then
  echo "external-cluster: the cluster (or the Prefect API) was not up within ${WAIT} s; logs in $LOGS:" >&2
  tail -n 5 "$LOGS"/*.log >&2 || true
  exit 1
fi
T_CLUSTER=$(now)
say "cluster and Prefect API up in $(secs "$T_START" "$T_CLUSTER") s: $WORKERS $KIND workers ($THREADS thread(s) each) at $ADDR"
sed 's/^/   /' "$WORK/workers.txt"
wait "$ARCHIVE_PID" || { cat "$LOGS/archive.log" >&2; echo "external-cluster: writing the synthetic archive failed" >&2; exit 1; }

# ------------------------------------------------------------------------------ 3. the store
run_sf() {  # run_sf NAME ARGS...: scanforest with its JSON summary in WORK/NAME.json, its stderr in logs
  local name=$1
  shift
  local rc=0
  timeout -k 10 "$RUN_TIMEOUT" "${SF_CMD[@]}" "$@" --json >"$WORK/$name.json" 2>"$LOGS/$name.log" || rc=$?
  if [[ $rc != 0 ]]; then
    echo "external-cluster: '${SF_CMD[*]} $*' failed (exit $rc$([[ $rc == 124 || $rc == 137 ]] && echo ": over RUN_TIMEOUT=$RUN_TIMEOUT s")); its output:" >&2
    tail -n 20 "$WORK/$name.json" "$LOGS/$name.log" >&2
    exit 1
  fi
}
t=$(now)
run_sf ingest ingest "$WORK/archive" "$STORE" --scheduler "$ADDR"
say "ingest --scheduler: $(secs "$t" "$(now)") s"
t=$(now)
run_sf describe describe "$STORE" --device "$DEVICE" --scheduler "$ADDR" \
  --keypoint-radius "$KEYPOINT_RADIUS" --shot-radius "$SHOT_RADIUS"
say "describe --scheduler: $(secs "$t" "$(now)") s"
t=$(now)
run_sf index index build "$STORE" -r 'models__*' --shards "$WORKERS" --device "$DEVICE"
say "index build --shards $WORKERS: $(secs "$t" "$(now)") s"
cp -a "$STORE" "$A"
cp -a "$STORE" "$B"

# ------------------------------------------------------------------------------ 4. two match runs
say "run A: ${SF_CMD[*]} match $A --device $DEVICE --scheduler $ADDR (undisturbed)"
T_A0=$(now)
run_sf match-a match "$A" --device "$DEVICE" --scheduler "$ADDR"
T_A1=$(now)
say "run A: $(secs "$T_A0" "$T_A1") s"

victim_pid=$(awk -v v="$VICTIM" '$1 == v { print $2 }' "$WORK/workers.txt")
[[ -n "$victim_pid" ]] || { echo "external-cluster: no worker named $VICTIM" >&2; exit 1; }
kill -0 "$victim_pid" 2>/dev/null || { echo "external-cluster: worker $VICTIM (pid $victim_pid) died before run B" >&2; exit 1; }

say "run B: ${SF_CMD[*]} match $B --device $DEVICE --scheduler $ADDR, SIGKILL to $VICTIM (pid $victim_pid) once $KILL_AFTER scan(s) are matched"
rm -f "$WORK/kill.txt"
T_B0=$(now)
setsid timeout -k 10 "$RUN_TIMEOUT" "${SF_CMD[@]}" match "$B" --device "$DEVICE" --scheduler "$ADDR" --json >"$WORK/match-b.json" 2>"$LOGS/match-b.log" </dev/null &
MATCH_B=$!
GROUPS_STARTED+=("$MATCH_B")

# the watcher: scans whose match_ids B has written, polled every 20 ms; at KILL_AFTER, SIGKILL
watch_and_kill() {
  shopt -s nullglob
  local done_files
  while kill -0 "$MATCH_B" 2>/dev/null; do
    done_files=("$B"/scans/*/match_ids/zarr.json)
    if [[ ${#done_files[@]} -ge $KILL_AFTER ]]; then
      local t
      t=$(now)
      if kill -KILL "$victim_pid" 2>/dev/null; then
        echo "killed $t ${#done_files[@]}" >"$WORK/kill.txt"
      else
        echo "gone $t ${#done_files[@]}" >"$WORK/kill.txt"
      fi
      return 0
    fi
    sleep 0.02
  done
  echo "ended $(now) 0" >"$WORK/kill.txt"
}
watch_and_kill &
WATCHER=$!
rc_b=0
wait "$MATCH_B" || rc_b=$?
T_B1=$(now)
wait "$WATCHER" || true
say "run B: $(secs "$T_B0" "$T_B1") s (exit $rc_b)"
if [[ $rc_b != 0 ]]; then
  echo "external-cluster: run B failed (exit $rc_b$([[ $rc_b == 124 || $rc_b == 137 ]] && echo ": over RUN_TIMEOUT=$RUN_TIMEOUT s")); its output:" >&2
  tail -n 30 "$WORK/match-b.json" "$LOGS/match-b.log" >&2
  exit 1
fi
read -r k_what k_time k_done < "$WORK/kill.txt" || { echo "external-cluster: the watcher left no record" >&2; exit 1; }
case "$k_what" in
  killed) ;;
  gone) echo "external-cluster: worker $VICTIM (pid $victim_pid) was already gone when the kill was due" >&2; exit 1 ;;
  *) echo "external-cluster: kill landed after the run: run B ended before $KILL_AFTER scan(s) were seen matched" >&2; exit 1 ;;
esac
if awk -v k="$k_time" -v e="$T_B1" 'BEGIN { exit !(k >= e) }'; then
  echo "external-cluster: kill landed after the run (at +$(secs "$T_B0" "$k_time") s of a $(secs "$T_B0" "$T_B1") s run)" >&2
  exit 1
fi
if [[ "$k_done" -ge "$SCANS" ]]; then
  echo "external-cluster: kill landed after the matching: all $SCANS scans had their matches written when $VICTIM was killed (+$(secs "$T_B0" "$k_time") s of a $(secs "$T_B0" "$T_B1") s run)" >&2
  exit 1
fi
lost=$(grep -h "lose already computed task" "$LOGS/scheduler.log" | head -n 1 | sed 's/.*WARNING - //' | cut -c1-240 || true)
[[ -n "$lost" ]] && say "scheduler: $lost"
say "killed $VICTIM (pid $victim_pid) at +$(secs "$T_B0" "$k_time") s of run B, when $k_done of $SCANS scans had matches written"

# ------------------------------------------------------------------------------ 5. compare
"$PY" "$HERE/compare_matches.py" "$STORE" "$A" "$B" "$WORK" "$ADDR" "$VICTIM" "$victim_pid" "$SCANS" "$KIND" \
  "$PROTOCOL" "$NANNY" "$(secs "$T_A0" "$T_A1")" "$(secs "$T_B0" "$T_B1")" "$(secs "$T_B0" "$k_time")" "$k_done"
