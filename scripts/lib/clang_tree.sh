# Sourced by scripts/run_sanitizers.sh and scripts/run_fuzz.sh: configures the clang build trees.
#   clang_tree_configure asan   -> build-asan: ASan + UBSan, and the libFuzzer targets (fuzz/)
#   clang_tree_configure tsan   -> build-tsan: ThreadSanitizer
# The fuzz targets live in the ASan tree rather than a tree of their own: both need clang with
# ASan + UBSan, and one tree compiles the library once instead of twice (an instrumented compile
# of the whole library is several minutes on CI's 2 cores). The price is the fuzzers' coverage
# instrumentation in the test binary too, which slows the ASan suite a little.
# Compiled at -O1 with line tables only (-g1): the sanitizers' own advice, and on 2 cores about
# 4x faster to build than gcc at -O2 -g. Configuring again is cheap and idempotent, so every call
# configures (a tree from an older layout of these scripts is brought up to date).
clang_tree_configure() {
  local kind=$1 dir="build-$1" extra=()
  case "$kind" in
    asan) extra=(-DTENSORSTASH_SANITIZE=address,undefined -DTENSORSTASH_FUZZ=ON) ;;
    tsan) extra=(-DTENSORSTASH_SANITIZE=thread -DTENSORSTASH_FUZZ=OFF) ;;
    *) echo "clang_tree_configure: unknown kind '$kind' (asan or tsan)" >&2; return 2 ;;
  esac
  # A tree configured with gcc (before the switch to clang) is configured afresh.
  if [ -f "$dir/CMakeCache.txt" ] && ! grep -q '^CMAKE_CXX_COMPILER:.*clang++' "$dir/CMakeCache.txt"; then
    rm -rf "$dir"
  fi
  local generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  cmake -S . -B "$dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
    "${extra[@]}" >/dev/null
}
