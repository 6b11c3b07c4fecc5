#!/usr/bin/env bash
# The test command: installs and starts what the tests need (scripts/setup.sh: apt packages,
# dockerd, the venv), then runs both tiers: fast unit tests and the integration tests against the
# real Docker daemon and registry. Extra arguments go to pytest (e.g. -m "not integration").
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
bash scripts/setup.sh test
export TESTCONTAINERS_RYUK_DISABLED=true
# Every temp file of the run in one dir, removed at its end (finish, below). Torch keeps Inductor's precompiled
# headers (140-160 MB each, one per compiler command line, so new for each checkout's path) in
# $TMPDIR/torchinductor_$USER whatever TORCHINDUCTOR_CACHE_DIR says: a day of runs left 11 GiB in /tmp, and a
# CI run's builds then found 3.3 GiB free for Docker, under the 4 GiB they need (stop 54).
RUN_TMP="$(mktemp -d "${TMPDIR:-/tmp}/mopt-test.XXXXXX")"
export TMPDIR="$RUN_TMP"
SESSIONS="$RUN_TMP/sessions"  # the sessions lowest() started, ended with test.sh
finish() {
    local sid
    if [ -f "$SESSIONS" ]; then
        while read -r sid; do kill -- "-$sid" 2>/dev/null || true; done < "$SESSIONS"  # its process group
    fi
    rm -rf "$RUN_TMP"
}
trap finish EXIT
# CI has the machine to itself: the fault test that restarts dockerd (stopping every container) may run.
if [ "${CI:-}" = "true" ]; then export MOPT_ALLOW_DOCKERD_RESTART=1; fi
# Builds leave stage images behind whenever an input changes (GBs each): before the run, drop mopt's
# images that neither the tests' state nor the demo's names, and keep BuildKit's cache within 20 GiB
# (the vLLM cpu image alone takes about 11 minutes to rebuild when its layers are evicted).
CACHE_GIB="${MOPT_TEST_BUILD_CACHE_GIB:-20}"
.venv/bin/python -m builder prune --state-dir .mopt/test-state --keep-state .mopt --build-cache-gib "$CACHE_GIB" | tail -n 3 \
    || echo "test.sh: mopt prune failed (see above); running the tests anyway" >&2
# Measured in two fresh runs (3cf90be, d2a4d57; Docker's data root empty): the disk in use peaked 38-40 GiB above
# where it was before the clone (Docker's about 30, this run's temp dir 7-8, the clone and its venv about 4).
# With less free than test.sh's share of that, say so up front: emptying the cache would not help, as a run
# from an empty one needs the most. Free space as the builds' own check measures it (builder/dockerclient.py).
free="$(.venv/bin/python -c 'from builder.dockerclient import docker_free_gib; print(int(docker_free_gib()))' || true)"
if [ "${free:-0}" -lt 36 ]; then
    echo "test.sh: warning: ${free:-0} GiB free for Docker; a run from an empty build cache takes up to 36 GiB" \
         "(less with this machine's cache): builds may be refused for want of disk" >&2
fi
PYTEST=(.venv/bin/python -m pytest -p no:cacheprovider)
# The integration tier runs one module at a time in name order, in three phases, with a second lane beside
# the second (the CPU idles half the time there: one pip, one compile, one server at a time):
# - BEFORE (the modules named before BESIDE's first) alone: test_faults restarts dockerd;
# - BESIDE, while the modules of LANE (images no other module builds: CUDA from PyPI, torch-inductor) run
#   in a state dir of their own (one mopt per state dir);
# - AFTER (the rest: server timings, benches, prune), with the lane's end awaited; beside them, at the
#   lowest CPU weight (lowest(), below), the unit files of UNIT_BESIDE: fuzzers, rule checks, CPU compiles,
#   no bound on the clock but hang guards of 60 s and more around runs of milliseconds to 70 s.
# Then the rest of the unit tier over the cores. Put a module in the lane only if nothing in it or beside it
# waits on the clock. Not from the first phase: tried (771d235), the files beside phases 1 and 2 made them
# 4.4 min slower on a fresh machine, though they had a quarter of phase 1's CPU idle (Docker's builds and
# pushes wait on memory and disk, not only CPU).
LANE=(tests/integration/test_cuda_from_pypi.py tests/integration/test_inductor_cpu.py)
BESIDE=(test_hardened_image test_hub_model test_infra test_lock_repro)
UNIT_BESIDE=(tests/unit/test_runtime_gpu_paths.py tests/unit/test_config_fuzz.py tests/unit/test_runtime_qwen3.py
             tests/unit/test_forward_compat.py tests/unit/test_bad_config_fuzz.py tests/unit/test_families.py
             tests/unit/test_conventions.py tests/unit/test_cli.py tests/unit/test_substitutes.py
             tests/unit/test_render.py tests/unit/test_doctor.py tests/unit/test_packed.py tests/unit/test_quantize.py
             tests/unit/test_fused_qk.py tests/unit/test_merged.py tests/unit/test_render_determinism.py
             tests/unit/test_backend_contract.py tests/unit/test_contract.py tests/unit/test_compat_rules.py
             tests/unit/test_attest_signing.py tests/unit/test_attest_contract.py tests/unit/test_backends_tensorrt.py
             tests/unit/test_gpu_problem.py tests/unit/test_matrix_rules.py tests/unit/test_sbom_cyclonedx.py
             tests/unit/test_plan_rules.py tests/unit/test_workflows.py tests/unit/test_modelcache.py)
# The unit tier's longest files, longest first: pytest-xdist starts them first (MOPT_TESTS_FIRST, read by
# tests/conftest.py, with --no-loadscope-reorder), so a run does not end on one of them alone. Measured
# alone on this machine's 2 cores: the rest of the unit tier took 256 s in xdist's order on 2 processes,
# 223 s in this order on 3, and 174 s once mopt's commands stopped importing rfc3987-syntax (pyproject.toml).
# test_modelcache (CPU compiles, guards of 300 s and more) went to UNIT_BESIDE: the fresh run of 60bf9e1 had
# phase 3's last 6 min 30% idle after UNIT_BESIDE ended, then the rest of the unit tier CPU-bound for 191 s.
# test_modelcache_processes and test_runtime_minilm stay here: they time a stop (60 s) and 100 sockets (2 s).
# Measured fresh (f0b8c88 against 60bf9e1): the rest 37 s shorter, phase 3 51 s longer though test_model_runtime
# had lost a compile (-38 s): at the lowest weight, CPU work beside phase 3 still costs it time. It stays, as
# libyaml (builder/yamlio.py) took about 100 CPU-s from the fuzz files beside it.
export MOPT_TESTS_FIRST="tests/unit/test_modelcache.py tests/unit/test_runtime_minilm.py tests/unit/test_modelcache_processes.py
    tests/unit/test_bench.py
    tests/unit/test_kb_check.py tests/unit/test_server_http.py tests/unit/test_service_limits.py
    tests/unit/test_hub_source.py tests/unit/test_hostile_config.py tests/unit/test_statelock.py
    tests/unit/test_runtime_gpu_paths.py tests/unit/test_packed.py tests/unit/test_bad_config_fuzz.py
    tests/unit/test_quantize.py tests/unit/test_runtime_qwen3.py tests/unit/test_config_fuzz.py
    tests/unit/test_families.py"
lowest() {  # COMMAND...: at the lowest CPU weight there is, so that it takes only CPU nobody else wants.
    # `nice` alone ranks a process only within its scheduling group: with autogroups on (the default of
    # Debian's kernels), one per session, and test.sh's group competes with the containers' cgroup as an
    # equal. So the command gets a session (a group) of its own at nice 19 too. Measured: niced 10 in
    # test.sh's session, unit files beside AFTER made the release bench's server answer 503 (docs/testing.md).
    # --wait: where the caller leads a process group, setsid forks, and its status must still be the command's.
    setsid --wait bash -c 'echo "$$" >> "$0"; echo 19 2>/dev/null > /proc/self/autogroup; exec nice -n 19 "$@"' \
        "$SESSIONS" "$@"
}
background() {  # DIR COMMAND...: the command (pytest and its arguments) in the background, its output in
    local dir="$1"  # DIR/log; sets BG_PID. It starts once the file AFTER_FILE (if set) exists.
    shift
    (
        while [ -n "${AFTER_FILE:-}" ] && [ ! -e "$AFTER_FILE" ]; do sleep 5; done
        begun=$SECONDS status=0
        "$@" || status=$?
        echo "test.sh: this lane took $(( SECONDS - begun )) s"
        exit "$status"
    ) > "$dir/log" 2>&1 &
    BG_PID=$!
}
await() {  # PID DIR TITLE: waits, prints the lane's output under TITLE; returns its status
    local status=0
    wait "$1" || status=$?
    echo "test.sh: $3:"
    cat "$2/log"
    rm -rf "$2"
    return "$status"
}
rc=0
# The mutation check on a sample of the core's mutants, drawn anew for each commit (the full run and its
# score: docs/testing.md). Only on the plain test command: extra pytest arguments mean a partial run. It
# runs beside pytest, niced (CPU-bound, while the integration tier mostly waits on Docker), and prints
# when pytest is done: together they took 46 min in a row on 2 cores.
sample="${MOPT_MUTATION_SAMPLE:-300}"
mutation_pid="" mutation_ended=""
if [ "$#" -eq 0 ] && [ "$sample" != 0 ]; then
    seed=$((16#$(git rev-parse --short=7 HEAD 2>/dev/null || echo 0)))
    mutation_log="$(mktemp)"
    mutation_tmp="$(mktemp -d)"  # its pytest runs number their temp dirs apart from the main run's
    mutation_ended="$mutation_tmp/ended"  # a file, not the pid: pids are reused (pid_max can be 32768)
    (
        status=0
        TMPDIR="$mutation_tmp" nice -n 10 .venv/bin/python scripts/mutation.py --fresh --sample "$sample" --seed "$seed" \
            > "$mutation_log" 2>&1 || status=$?
        touch "$mutation_ended"
        exit "$status"
    ) &
    mutation_pid=$!
fi
if [ "$#" -eq 0 ]; then
    before=() beside=() after=() unit_rest=()
    for module in tests/integration/test_*.py; do
        name="$(basename "$module" .py)"
        if [[ " ${LANE[*]} " == *" $module "* ]]; then continue
        elif [[ " ${BESIDE[*]} " == *" $name "* ]]; then beside+=("$module")
        elif [[ "$name" < "${BESIDE[0]}" ]]; then before+=("$module")
        else after+=("$module"); fi
    done
    for module in "${UNIT_BESIDE[@]}"; do unit_rest+=(--ignore "$module"); done
    workers=$(nproc 2>/dev/null || echo 2)
    workers=$(( workers > 4 ? 4 : workers < 1 ? 1 : workers ))
    started=$SECONDS
    "${PYTEST[@]}" --durations=10 "${before[@]}" || rc=$?
    lane_dir="$(mktemp -d)"
    MOPT_TEST_STATE_DIR="$REPO/.mopt/test-state-lane" background "$lane_dir" \
        "${PYTEST[@]}" --durations=10 --basetemp "$lane_dir/tmp" "${LANE[@]}"
    lane_pid=$BG_PID
    "${PYTEST[@]}" --durations=10 "${beside[@]}" || rc=$((rc ? rc : $?))
    await "$lane_pid" "$lane_dir" "beside ${BESIDE[*]}, the lane ran ${LANE[*]}" || rc=$((rc ? rc : $?))
    unit_dir="$(mktemp -d)"
    # Not beside the mutation sample, if it is still running: at the lowest weight, its group would starve them.
    # Over the cores: a group's weight is the group's, however many processes share it, so a second process
    # takes nothing more from the modules beside it and uses more of the CPU they leave idle.
    AFTER_FILE="$mutation_ended" background "$unit_dir" lowest "${PYTEST[@]}" --durations=10 --basetemp "$unit_dir/tmp" \
        -n "$workers" --dist loadfile --no-loadscope-reorder "${UNIT_BESIDE[@]}"
    unit_pid=$BG_PID
    "${PYTEST[@]}" --durations=10 "${after[@]}" || rc=$((rc ? rc : $?))
    echo "test.sh: the integration tier took $(( SECONDS - started )) s"
    started=$SECONDS
    rest_workers=$((workers + 1))  # test_bench, test_server_http and test_service_limits mostly wait on sockets
    "${PYTEST[@]}" --durations=25 -n "$rest_workers" --dist loadfile --no-loadscope-reorder "${unit_rest[@]}" tests/unit \
        || rc=$((rc ? rc : $?))
    echo "test.sh: the rest of the unit tier took $(( SECONDS - started )) s on $rest_workers processes"
    await "$unit_pid" "$unit_dir" "beside the integration tier's last modules, at the lowest CPU weight, the unit files ${UNIT_BESIDE[*]}" \
        || rc=$((rc ? rc : $?))
else
    "${PYTEST[@]}" --durations=25 "$@" tests || rc=$?
fi
if [ -n "$mutation_pid" ]; then
    mutation_rc=0
    wait "$mutation_pid" || mutation_rc=$?
    cat "$mutation_log"
    rm -rf "$mutation_log" "$mutation_tmp"
    if [ "$mutation_rc" != 0 ]; then rc=$((rc ? rc : 1)); fi
fi
# A CI clone is thrown away after the run: give its images' disk back now, not at the next run.
if [ "${CI:-}" = "true" ]; then
    .venv/bin/python -m builder prune --state-dir .mopt --build-cache-gib "$CACHE_GIB" | tail -n 3 || true
fi
exit "$rc"
