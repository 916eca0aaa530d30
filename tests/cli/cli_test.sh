#!/usr/bin/env bash
# End-to-end test of the tensorstash CLI on a checkpoint written by the example program:
# ls / inspect / inspect --json / verify on a good step, then verify on damaged ones.
# Usage: cli_test.sh BUILD_DIR
set -uo pipefail
BUILD=$1
CLI=$BUILD/tensorstash
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
failures=0
check() {  # check DESCRIPTION COMMAND...: the command must succeed
  if "${@:2}"; then echo "ok   $1"; else echo "FAIL $1"; failures=$((failures + 1)); fi
}

"$BUILD/sharded_save_restore" --root "$WORK/ckpt" --size-mib 4 --runs 1 --step 42 > "$WORK/example.txt" 2>&1
check "example succeeds and checks bit for bit" grep -q "bit-for-bit OK" "$WORK/example.txt"
STEP=$WORK/ckpt/0000000042

"$CLI" ls "$WORK/ckpt" > "$WORK/ls.txt" 2>&1
check "ls lists the step as complete" grep -Eq "^0000000042 +complete" "$WORK/ls.txt"
mkdir -p "$WORK/ckpt/0000000043.tmp-abc/state" && echo x > "$WORK/ckpt/0000000043.tmp-abc/state/index"
mkdir -p "$WORK/ckpt/0000000044/state" && echo x > "$WORK/ckpt/0000000044/state/index"
"$CLI" ls "$WORK/ckpt" > "$WORK/ls.txt" 2>&1
check "ls shows a temporary folder as temporary" grep -Eq "^0000000043.tmp-abc +temporary" "$WORK/ls.txt"
check "ls shows a folder without COMMIT as incomplete" grep -Eq "^0000000044 +incomplete" "$WORK/ls.txt"
# Issue 13, item 15: a COMMIT that still parses but whose checks are wrong is damaged, not complete.
cp -r "$STEP" "$WORK/ckpt/0000000045"
python3 - "$WORK/ckpt/0000000045/COMMIT" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
text = re.sub(r'"tree_crc32c": (\d+)', lambda m: f'"tree_crc32c": {(int(m[1]) + 1) % 2**32}', text)
open(sys.argv[1], "w").write(text)
PY
"$CLI" ls "$WORK/ckpt" > "$WORK/ls.txt" 2> "$WORK/ls_err.txt"
check "ls shows a step whose COMMIT does not check as damaged" grep -Eq "^0000000045 +damaged" "$WORK/ls.txt"
check "ls says why a step is damaged" grep -q "damaged: 0000000045: .*tree.json" "$WORK/ls_err.txt"
check "ls still shows the good step as complete" grep -Eq "^0000000042 +complete" "$WORK/ls.txt"
rm -rf "$WORK/ckpt/0000000045"

"$CLI" inspect "$STEP" > "$WORK/inspect.txt" 2>&1
check "inspect shows a row per array" grep -Eq "^params/embedding +float32 +\(128, 2048\)" "$WORK/inspect.txt"
check "inspect shows the codec" grep -Eq "^data/token_counts .* zstd$" "$WORK/inspect.txt"
"$CLI" inspect --json "$STEP" > "$WORK/inspect.json" 2>&1
check "inspect --json is JSON with 8 arrays" python3 -c "
import json, sys
doc = json.load(open('$WORK/inspect.json'))
assert len(doc['arrays']) == 8, doc
a = {x['path']: x for x in doc['arrays']}
assert a['step']['shape'] == [] and a['step']['dtype'] == 'int64'
assert a['params/embedding']['stored_bytes'] == 128 * 2048 * 4
"

"$CLI" verify "$STEP" > "$WORK/verify.txt" 2>&1
check "verify passes a good step" grep -q "^OK: " "$WORK/verify.txt"

# Flip one byte inside the first data file: verify must exit 1 and name the chunk.
cp -r "$STEP" "$WORK/ckpt/0000000050"
python3 - "$WORK/ckpt/0000000050/state/data/0-0.dat" <<'PY'
import sys
with open(sys.argv[1], "r+b") as f:
    f.seek(4096 + 100)
    b = f.read(1)
    f.seek(4096 + 100)
    f.write(bytes([b[0] ^ 0x10]))
PY
"$CLI" verify "$WORK/ckpt/0000000050" > "$WORK/verify_bad.txt" 2>&1
code=$?
check "verify exits 1 on a flipped byte" test "$code" -eq 1
check "verify names the bad chunk, array and file" grep -Eq "^BAD  .* chunk \[.*\] \(.*data/0-0.dat\): CRC-32C mismatch" "$WORK/verify_bad.txt"
check "verify reports exactly one bad chunk" grep -q "FAILED: 1 of" "$WORK/verify_bad.txt"

# A step without COMMIT cannot be opened: exit 2 with a message that says so.
"$CLI" verify "$WORK/ckpt/0000000044" > "$WORK/verify_nocommit.txt" 2>&1
code=$?
check "verify exits 2 on a step without COMMIT" test "$code" -eq 2
check "the error says the step has no COMMIT" grep -q "no COMMIT" "$WORK/verify_nocommit.txt"

# A truncated data file: verify lists bad chunks rather than stopping.
cp -r "$STEP" "$WORK/ckpt/0000000051"
truncate -s 5000 "$WORK/ckpt/0000000051/state/data/0-0.dat"
"$CLI" verify "$WORK/ckpt/0000000051" > "$WORK/verify_trunc.txt" 2>&1
code=$?
check "verify exits 1 on a truncated data file" test "$code" -eq 1
check "verify says the file is truncated" grep -q "truncated" "$WORK/verify_trunc.txt"

# Issue 13, items 9 and 10: a 300-byte Orbax checkpoint whose zarr metadata claims an absurd
# grid or shape. verify and convert end at once with a clear error (exit 2), never hang, never
# abort (std::bad_alloc was exit 134), and memory stays small (ulimit -v: 2 GiB).
hostile() {  # hostile DIR SHAPE CHUNK: a folder-layout Orbax checkpoint of one float32 array "a"
  mkdir -p "$1/a"
  cat > "$1/_METADATA" <<JSON
{"tree_metadata": {"('a',)": {"key_metadata": [{"key": "a", "key_type": 2}],
 "value_metadata": {"value_type": "np.ndarray", "skip_deserialize": false}}},
 "use_ocdbt": false, "store_array_data_equal_to_fill_value": false}
JSON
  cat > "$1/a/.zarray" <<JSON
{"zarr_format": 2, "shape": [$2], "chunks": [$3], "dtype": "<f4", "compressor": null,
 "fill_value": 0, "order": "C", "filters": null}
JSON
}
hostile "$WORK/hostile_grid" 1099511627776 1
hostile "$WORK/hostile_shape" 274877906944 262144
for what in grid shape; do
  for cmd in verify convert; do
    args=("$WORK/hostile_$what")
    [ "$cmd" = convert ] && args+=(--to native "$WORK/converted_$what")
    (ulimit -v 2097152; timeout 60 "$CLI" "$cmd" "${args[@]}") > "$WORK/hostile.txt" 2>&1
    code=$?
    # A huge shape on a plausible grid with no chunk stored is a valid array of fill values:
    # verify checks that nothing is stored and passes it; convert to native cannot store it.
    want=2
    [ "$what/$cmd" = shape/verify ] && want=0
    check "$cmd of a checkpoint with a hostile $what exits $want (got $code)" test "$code" -eq "$want"
  done
done
"$CLI" verify "$WORK/hostile_grid" > "$WORK/hostile.txt" 2>&1
check "the error names the absurd grid" grep -q "1099511627776 chunks" "$WORK/hostile.txt"
"$CLI" convert --to native "$WORK/hostile_shape" "$WORK/converted_shape" > "$WORK/hostile.txt" 2>&1
check "convert says the arrays do not fit on the disk" grep -q "bytes free at" "$WORK/hostile.txt"
check "a failed convert leaves nothing at DST" test ! -e "$WORK/converted_shape"

"$CLI" inspect "$WORK/nope" > "$WORK/missing.txt" 2>&1
code=$?
check "inspect of a missing path exits 2" test "$code" -eq 2
for cmd in ls inspect verify; do
  check "$cmd --help" bash -c "'$CLI' $cmd --help | grep -q Usage"
done

echo "$failures failed"
exit $((failures > 0))
