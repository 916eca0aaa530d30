#!/usr/bin/env bash
# The C++ test suite under sanitizers (docs/reliability.md):
#   build-asan: AddressSanitizer + UndefinedBehaviorSanitizer, the whole GoogleTest suite;
#   build-tsan: ThreadSanitizer, the tests that run threads against each other (thread pool,
#               writers and readers of several in-process "processes", concurrency, faults, manager,
#               the restore that reads one batch ahead).
# Lean builds: the test binary and its helper programs only (no Python, CLI, examples, benchmarks).
# Configured by scripts/lib/clang_tree.sh: clang at -O1 -g1 (on this 2-core machine about 4x
# faster to build than gcc at -O2 -g: orbax_reader.cc 118 s against 29 s); the ASan tree also
# holds the fuzz targets (scripts/run_fuzz.sh). Stack traces keep file and line.
# Usage: scripts/run_sanitizers.sh [--build-only] [asan|tsan]...   (default: both)
#   --build-only: configure and build, run nothing (run_tests.sh builds these trees in the
#   background while pytest runs, then calls this script again to run the tests).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/clang_tree.sh
BUILD_ONLY=0
if [ "${1:-}" = "--build-only" ]; then BUILD_ONLY=1; shift; fi
KINDS=("$@")
[ ${#KINDS[@]} -eq 0 ] && KINDS=(asan tsan)
JOBS=$(nproc)
# Stop at the first report; LeakSanitizer on; TSan reports are errors.
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:detect_stack_use_after_return=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}
# The tests that exercise threads against each other, by ctest name.
TSAN_FILTER='ThreadPool|HostRestore|TaskGroup|ByteLimiter|StagingPool|MultiWriter|InProcessCoordinator|Manager|CheckpointFault|OrbaxWriterFault|CheckpointConcurrency|Conformance.*Concurrent|Conformance.*WriteIfAbsent'
status=0
for kind in "${KINDS[@]}"; do
  case "$kind" in
    asan) filter=() ; exclude='^cli\.' ;;
    # The SIGKILL test of incremental saves forks a child that runs the manager's threads, which
    # TSan does not support after fork; the gcc and ASan suites run it.
    tsan) filter=(-R "$TSAN_FILTER") ; exclude='^cli\.|ManagerIncrementalCrashTest' ;;
    *) echo "run_sanitizers: unknown kind '$kind' (asan or tsan)" >&2; exit 2 ;;
  esac
  dir="build-$kind"
  start=$(date +%s)
  clang_tree_configure "$kind" || { status=1; continue; }
  if ! cmake --build "$dir" -j "$JOBS" --target tensorstash_tests; then
    status=1
    continue
  fi
  built=$(date +%s)
  # The TSan tree compiles only the files of the tests TSAN_FILTER selects (CMakeLists.txt,
  # TS_TSAN_TEST_FILES). Where the full gcc build is at hand, check that no selected test was left
  # out, so that a new threaded test in another file cannot silently escape TSan.
  if [ "$kind" = tsan ] && [ -x build/tensorstash_tests ]; then
    selected() { "$1" --gtest_list_tests | awk '/^[^ ]/ {s=$1} /^ / {print s $1}' | grep -E "$TSAN_FILTER" | sort; }
    missing=$(comm -23 <(selected build/tensorstash_tests) <(selected "$dir/tensorstash_tests"))
    if [ -n "$missing" ]; then
      echo "run_sanitizers: tests TSAN_FILTER selects are not in the TSan build; add their files" \
        "to TS_TSAN_TEST_FILES in CMakeLists.txt:" >&2
      echo "$missing" | head -20 >&2
      status=1
      continue
    fi
  fi
  if [ "$BUILD_ONLY" = 1 ]; then
    echo "run_sanitizers: $kind built in $((built - start)) s (build only)"
    continue
  fi
  # The CLI test needs the CLI, which this lean build leaves out. Each test in its own process;
  # TSan slows threads 5-15x, hence the longer timeout.
  rm -f "$dir/Testing/Temporary/LastTestsFailed.log"
  (cd "$dir" && ctest --output-on-failure -j "$JOBS" --timeout 900 -E "$exclude" "${filter[@]}") || status=1
  end=$(date +%s)
  echo "run_sanitizers: $kind built in $((built - start)) s, tests ran in $((end - built)) s"
done
exit $status
