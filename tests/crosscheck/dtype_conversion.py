#!/usr/bin/env python3
"""Cross-checks tensorstash's ConvertElements against numpy + ml_dtypes, bit for bit.

Usage: python dtype_conversion.py TOOLS_DIR   (TOOLS_DIR holds the convert_tool binary)

The reference for every conversion is `np.asarray(x, dtype=src).astype(dst)`. Results are compared
as raw bits, NaNs included (payload and sign): no NaN is treated as equal to another NaN.

Covered:
  - every float dtype to every other float dtype (and to itself): all bit patterns for the 8- and
    16-bit sources; for float32/float64 sources, specials, every finite value of each narrow
    target, the rounding midpoints between them and their neighbours (one source ulp away, and
    for float64 also far below a float32 ulp, which tells single from double rounding), the
    overflow thresholds, NaNs with many payloads and a large random sample;
  - bool and every integer dtype to every float dtype (exhaustive up to 16 bits; for wider ones
    extremes, rounding ties and random values);
  - integer/bool to integer/bool for in-range values, and the out-of-range error (exit 1, message
    naming the value and both dtypes);
  - bool bytes other than 0/1 read as true (see the note in main for ml_dtypes targets);
  - complex64 <-> complex128;
  - the narrower ml_dtypes types: float8_e3m4, float8_e4m3, float8_e4m3fnuz, float8_e5m2fnuz,
    float8_e4m3b11fnuz, float8_e8m0fnu, float6_e2m3fn, float6_e3m2fn, float4_e2m1fn among the
    floats (all 256 bytes as sources), int2, int4, uint2, uint4 among the integers (all 256 bytes:
    the bits above the value's are ignored);
  - every unsupported pair fails with "not supported".
Exits 1 on any mismatch, listing the first few with hex bits.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import warnings

import ml_dtypes
import numpy as np

# ml_dtypes' narrower floats (float8 variants, float6, float4: one byte per element).
SMALL_FLOATS = ["float8_e3m4", "float8_e4m3", "float8_e4m3fnuz", "float8_e5m2fnuz",
                "float8_e4m3b11fnuz", "float8_e8m0fnu", "float6_e2m3fn", "float6_e3m2fn",
                "float4_e2m1fn"]
FLOATS = ["float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"
          ] + SMALL_FLOATS
SUB_BYTE_INTS = ["int2", "int4", "uint2", "uint4"]
INTS = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"
        ] + SUB_BYTE_INTS
COMPLEX = ["complex64", "complex128"]
ALL = INTS + FLOATS + COMPLEX
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64, 16: None}
MAX_LISTED = 8

RNG = np.random.default_rng(20240607)


def dtype(name):
    if hasattr(ml_dtypes, name) and name not in ("float16", "float32", "float64"):
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def iinfo(name):
    return ml_dtypes.iinfo(dtype(name)) if name in SUB_BYTE_INTS else np.iinfo(dtype(name))


def raw_bits(a):
    """The elements of `a` as unsigned integers of the same width (complex: one per part)."""
    a = np.ascontiguousarray(a)
    if a.dtype.kind == "c":
        a = a.view(np.float32 if a.dtype.itemsize == 8 else np.float64)
    return a.view(UINT[a.dtype.itemsize])


class Checker:
    def __init__(self, tools_dir):
        self.tool = os.path.join(tools_dir, "convert_tool")
        if not os.access(self.tool, os.X_OK):
            sys.exit(f"error: {self.tool} is not an executable")
        self.tmp = tempfile.mkdtemp(prefix="ts_dtype_conversion_")
        self.failures = []  # (pair, message lines)
        self.pairs_checked = 0
        self.elements_checked = 0

    def run_tool(self, src_name, dst_name, data):
        in_path = os.path.join(self.tmp, "in.bin")
        out_path = os.path.join(self.tmp, "out.bin")
        if os.path.exists(out_path):
            os.remove(out_path)
        np.ascontiguousarray(data).astype(data.dtype.newbyteorder("<")).tofile(in_path)
        proc = subprocess.run([self.tool, src_name, dst_name, in_path, out_path],
                              capture_output=True, text=True, check=False)
        out = None
        if proc.returncode == 0:
            out = np.fromfile(out_path, dtype=dtype(dst_name).newbyteorder("<"))
        return proc.returncode, out, proc.stderr.strip()

    def fail(self, pair, lines):
        self.failures.append((pair, lines))

    def compare(self, src_name, dst_name, x, got, expected):
        """Appends a failure unless `got` and `expected` agree bit for bit. Returns #mismatches."""
        pair = f"{src_name} -> {dst_name}"
        if got is None or got.shape != expected.shape:
            self.fail(pair, [f"wrong output size: {None if got is None else got.shape} "
                             f"vs {expected.shape}"])
            return -1
        g, e = raw_bits(got), raw_bits(expected)
        xs = raw_bits(x)
        if g.size != e.size:
            self.fail(pair, ["size mismatch"])
            return -1
        bad = np.flatnonzero(g != e)
        if bad.size:
            parts = g.size // xs.size  # 2 for complex (one entry per part)
            width = 2 * e.dtype.itemsize
            lines = [f"{bad.size} of {g.size} differ"]
            for i in bad[:MAX_LISTED]:
                src_bits = xs[i // parts] if parts > 1 else xs[i]
                src_hex = f"0x{int(src_bits):0{2 * xs.dtype.itemsize}x}"
                lines.append(f"  in {src_hex} ({x.flat[i // parts]!r}): "
                             f"expected 0x{int(e[i]):0{width}x} got 0x{int(g[i]):0{width}x}")
            self.fail(pair, lines)
        return bad.size

    def check(self, src_name, dst_name, x):
        x = np.asarray(x, dtype=dtype(src_name))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                expected = x.astype(dtype(dst_name))
            except TypeError:
                # ml_dtypes registers no cast between some of its own types (float8_e8m0fnu ->
                # float4_e2m1fn); the reference is then the value through float32, which is
                # exact for every source here and how it converts every other pair.
                expected = x.astype(np.float32).astype(dtype(dst_name))
        rc, got, err = self.run_tool(src_name, dst_name, x)
        self.pairs_checked += 1
        self.elements_checked += x.size
        if rc != 0:
            self.fail(f"{src_name} -> {dst_name}", [f"tool failed (rc {rc}): {err}"])
            return
        self.compare(src_name, dst_name, x, got, expected)

    def expect_error(self, src_name, dst_name, x, needles):
        x = np.asarray(x, dtype=dtype(src_name))
        rc, _, err = self.run_tool(src_name, dst_name, x)
        self.pairs_checked += 1
        pair = f"{src_name} -> {dst_name} (expected failure)"
        if rc != 1:
            self.fail(pair, [f"exit code {rc}, wanted 1; stderr: {err!r}"])
            return
        missing = [n for n in needles if n not in err]
        if missing:
            self.fail(pair, [f"message {err!r} lacks {missing}"])


# ---------------------------------------------------------------------------------------------
# Inputs.

def all_patterns(name):
    """Every bit pattern; for the types of fewer than 8 value bits also the bytes with high bits
    set (read by their low bits, as ml_dtypes does)."""
    size = dtype(name).itemsize
    return np.arange(1 << (8 * size), dtype=UINT[size]).view(dtype(name))


def finite_values(name):
    """Every finite value of an 8/16-bit float dtype, as float64, sorted, -0 dropped."""
    v = all_patterns(name).astype(np.float64)
    v = v[np.isfinite(v)]
    return np.unique(v)


def rounding_points(name, wide):
    """Values of `wide` float type around each rounding decision of the narrow dtype `name`."""
    fin = finite_values(name)
    mids = (fin[:-1] + fin[1:]) / 2  # exact in float32 for these formats
    top = fin[-1]
    ulp_top = fin[-1] - fin[-2]
    beyond = np.array([top + ulp_top / 2, top + ulp_top, top * 2])  # overflow thresholds
    pts = np.concatenate([fin, mids, beyond]).astype(wide)
    inf = np.array([np.inf], dtype=wide)
    up = np.nextafter(pts, inf)
    down = np.nextafter(pts, -inf)
    out = [pts, up, down]
    if wide == np.float64:
        # Far below one float32 ulp: direct rounding sees it, rounding via float32 does not.
        tiny = np.abs(pts) * 2.0**-35
        out += [pts + tiny, pts - tiny]
    v = np.concatenate(out)
    return np.concatenate([v, -v])


def nan_patterns(name, count):
    size = dtype(name).itemsize
    u = UINT[size]
    mant_bits = {4: 23, 8: 52}[size]
    exp_all = ((1 << (8 * size - 1)) - 1) ^ ((1 << mant_bits) - 1)
    mant = RNG.integers(1, 1 << mant_bits, size=count, dtype=u)
    # Payloads with only high bits, only low bits, single bits: truncation edge cases.
    singles = np.array([1 << k for k in range(mant_bits)], dtype=u)
    lows = np.array([(1 << k) - 1 for k in range(1, mant_bits + 1)], dtype=u)
    mant = np.concatenate([mant, singles, lows])
    bits = u(exp_all) | mant
    bits = np.concatenate([bits, bits | u(1 << (8 * size - 1))])
    return bits.view(dtype(name))


def float_sample(name):
    wide = np.float32 if name == "float32" else np.float64
    size = np.dtype(wide).itemsize
    u = UINT[size]
    parts = [np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1 / 3, -1 / 3, 1.0,
                       np.finfo(wide).max, -np.finfo(wide).max, np.finfo(wide).tiny,
                       np.finfo(wide).smallest_subnormal, 65504.0, 65520.0, 448.0, 464.0,
                       57344.0, 61440.0], dtype=wide)]
    for narrow in ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"] + SMALL_FLOATS:
        parts.append(rounding_points(narrow, wide))
    if wide == np.float64:
        # float32 rounding points, for float64 -> float32 (and double rounding through it).
        f32 = RNG.integers(0, 1 << 32, size=200_000, dtype=np.uint32).view(np.float32)
        f32 = f32[np.isfinite(f32)].astype(np.float64)
        nxt = np.nextafter(f32.astype(np.float32), np.float32(np.inf)).astype(np.float64)
        mid = (f32 + nxt) / 2
        parts += [mid, np.nextafter(mid, np.inf), np.nextafter(mid, -np.inf)]
    parts.append(nan_patterns("float32" if wide == np.float32 else "float64", 2000))
    # Uniformly random bit patterns, then random values in the exponent range narrow types use.
    parts.append(RNG.integers(0, np.iinfo(u).max, size=1_000_000, dtype=u, endpoint=True)
                 .view(wide))
    mant = RNG.random(1_000_000)
    exps = RNG.integers(-150, 130, size=mant.size)
    signs = RNG.choice([-1.0, 1.0], size=mant.size)
    parts.append((signs * np.ldexp(1.0 + mant, exps)).astype(wide))
    return np.concatenate([np.asarray(p, dtype=wide) for p in parts])


def int_sample(name):
    dt = dtype(name)
    if name == "bool":
        return np.array([False, True, True, False])
    if name in SUB_BYTE_INTS:  # every byte: the high bits are ignored, as ml_dtypes does
        return np.arange(256, dtype=np.uint8).view(dt)
    if dt.itemsize <= 2:
        info = np.iinfo(dt)
        return np.arange(info.min, info.max + 1, dtype=np.int64).astype(dt)
    info = np.iinfo(dt)
    bits = 8 * dt.itemsize
    vals = [info.min, info.max, 0, 1, -1 if info.min < 0 else 2]
    # Ties and near-ties when rounding to each float's mantissa width (float8 2/3 bits, bfloat16 7,
    # float16 10, float32 23, float64 52), also one bit over (a second rounding step).
    for top in range(1, bits - (1 if info.min < 0 else 0)):
        for keep in (2, 3, 4, 7, 8, 10, 11, 23, 24, 52, 53):
            s = top - keep
            if s < 1:
                continue
            base = 1 << top
            for m in (0, 1, 3, (1 << (keep - 1)) - 1):
                for delta in (-1, 0, 1):
                    vals.append(base + (m << s) + (1 << (s - 1)) + delta)
                    if s > 2:
                        vals.append(base + (m << s) + (1 << (s - 1)) + (1 << (s - 2)))
        # A tie for the narrow float, nudged by a tie of the intermediate (float32 / float64):
        # tells int -> float32 -> narrow from int -> float64 -> float32 -> narrow.
        for k1 in (2, 3, 7, 10):
            for k2 in (23, 52):
                s1, s2 = top - k1, top - k2
                if s2 < 1:
                    continue
                for sign in (1, -1):
                    for delta in (-1, 0, 1):
                        vals.append((1 << top) + (1 << (s1 - 1)) + sign * (1 << (s2 - 1)) + delta)
    vals = [v for v in vals if info.min <= v <= info.max]
    neg = [-v for v in vals if info.min <= -v <= info.max]
    rnd = RNG.integers(info.min, info.max, size=200_000, dtype=dt, endpoint=True)
    lengths = RNG.integers(0, bits, size=200_000)
    short = (rnd.astype(np.uint64) >> lengths.astype(np.uint64)).astype(dt)
    return np.concatenate([np.array(vals + neg, dtype=object).astype(dt), rnd, short])


def float_source(name):
    if dtype(name).itemsize <= 2:
        return all_patterns(name)
    return float_sample(name)


# ---------------------------------------------------------------------------------------------

def main():
    warnings.simplefilter("ignore")  # numpy warns about overflow/NaN casts we make on purpose
    if len(sys.argv) != 2:
        sys.exit("usage: dtype_conversion.py TOOLS_DIR")
    c = Checker(sys.argv[1])
    try:
        return run_checks(c)
    finally:
        shutil.rmtree(c.tmp, ignore_errors=True)


def run_checks(c):

    # The comparison itself must be able to fail: one flipped bit has to be caught.
    probe = np.arange(16, dtype=np.uint16).view(dtype("bfloat16"))
    flipped = probe.copy().view(np.uint16)
    flipped[5] ^= 1
    if c.compare("self", "test", probe, flipped.view(dtype("bfloat16")), probe) != 1:
        sys.exit("error: the bit comparison did not notice a flipped bit")
    c.failures.clear()

    sources = {name: float_source(name) for name in FLOATS}
    for src in FLOATS:
        for dst in FLOATS:
            c.check(src, dst, sources[src])

    int_sources = {name: int_sample(name) for name in INTS}
    for src in INTS:
        for dst in FLOATS:
            c.check(src, dst, int_sources[src])

    for src in INTS:
        x = int_sources[src]
        for dst in INTS:
            if dst == "bool" or src == "bool":
                c.check(src, dst, x)
                continue
            info = iinfo(dst)
            big = x.astype(np.int64).astype(object) if src in SUB_BYTE_INTS else x.astype(object)
            inside = x[(big >= info.min) & (big <= info.max)]
            c.check(src, dst, inside)
            outside = x[(big < info.min) | (big > info.max)]
            if outside.size:
                bad = outside[-1]
                # One bad value after good ones: it is found and named, not just the first one.
                data = np.concatenate([inside[:100], [bad], inside[:3]]).astype(x.dtype)
                c.expect_error(src, dst, data, [str(int(bad)), src, dst, "in.bin",
                                                f"element {min(100, inside.size)}"])

    # Bool bytes other than 0/1 (not produced by NumPy, but possible in stored data) read as
    # true. NumPy's own casts agree; ml_dtypes' casts read the byte as a number, so for its
    # targets the reference is taken from the normalised bools (documented deviation).
    raw_bools = np.arange(256, dtype=np.uint8).view(np.bool_)
    for dst in FLOATS + INTS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = (raw_bools.view(np.uint8) != 0).astype(dtype(dst))
        rc, got, err = c.run_tool("bool", dst, raw_bools)
        c.pairs_checked += 1
        if rc != 0:
            c.fail(f"bool (raw bytes) -> {dst}", [f"tool failed (rc {rc}): {err}"])
        elif dst == "bool":
            if not np.array_equal(got.view(np.uint8), raw_bools.view(np.uint8)):
                c.fail("bool (raw bytes) -> bool", ["same-dtype copy changed the bytes"])
        else:
            c.compare("bool (raw bytes)", dst, raw_bools.view(np.uint8), got, expected)

    # complex64 <-> complex128: random parts plus the float rounding points.
    re32 = sources["float32"][:400_000]
    im32 = np.roll(re32, 7)
    z64 = np.zeros(re32.size, dtype=np.complex64)
    z64.real, z64.imag = re32, im32
    re64 = sources["float64"][:400_000]
    z128 = np.zeros(re64.size, dtype=np.complex128)
    z128.real, z128.imag = re64, np.roll(re64, 11)
    for src, z in (("complex64", z64), ("complex128", z128)):
        for dst in COMPLEX:
            c.check(src, dst, z)

    # Everything else must be refused.
    supported = set()
    for a in ALL:
        supported.add((a, a))
    for a in FLOATS + INTS:
        for b in FLOATS:
            supported.add((a, b))
    for a in INTS:
        for b in INTS:
            supported.add((a, b))
    supported |= {("complex64", "complex128"), ("complex128", "complex64")}
    for a in ALL:
        for b in ALL:
            if (a, b) not in supported:
                c.expect_error(a, b, np.zeros(1, dtype=dtype(a)), ["not supported", a, b])

    print(f"dtype_conversion: {c.pairs_checked} conversions, {c.elements_checked} elements "
          f"checked against numpy {np.__version__} / ml_dtypes {ml_dtypes.__version__}")
    if c.failures:
        print(f"FAILED: {len(c.failures)} conversions mismatch")
        for pair, lines in c.failures:
            print(f"{pair}:")
            for line in lines:
                print(f"  {line}")
        return 1
    print("OK: all conversions bit-exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
