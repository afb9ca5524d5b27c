"""64-bit indexing where an index can pass 2^31: a static check over the index products of the CUDA kernels and
launchers (csrc/cuda), at the largest shapes the README suggests.

Why static and not a large-shape emulator run: the product that passes 2^31 first is the classifier's row offset
n * Vp at d12's B * T = 65,536 rows (65,536 x 50,304 = 3.3e9 logits): 6.6 GB of bf16 (13 GB fp32) and 3.3e9 emulated
threads, hours on CI's 2 cores, and one shape only. The static check covers every product of every kernel, at the
bounds of the largest preset (d48: C = 1600, 25 heads) at the README's batch (B = 64, T = 1024, or T = 2048 with
--block-size 2048, so B * T = 65,536 rows per micro-step at most), in milliseconds.

The rule: every product chain `a * b * ...` in csrc/cuda whose factors include at least two sizes (names bounded in
BOUNDS: N, T, C, Vp, a row index, ...) and whose bound (the product of the factors' bounds) reaches 2^31 must be
computed in 64 bits: its first factor is size_t(...) / int64_t(...) / a variable declared size_t, so C++ evaluates
the whole chain left to right in 64 bits. Chains under 2^31 at the largest shapes may stay int (they are listed
with their bound by `python tests/csrc/cuda/test_index_width.py`). A name not in BOUNDS is not a size (a float, a
lane, a constant): a new size name in a kernel must be added to BOUNDS, which test_bounds_cover_the_kernels_sizes
checks for the kernels' int parameters.
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CUDA = ROOT / "csrc" / "cuda"
INT_MAX = 2**31 - 1

# The largest shapes (python/gpt2core/config.py PRESETS, README's batches): d48 at B * T = 65,536 rows.
ROWS, MAX_T, MAX_B, MAX_C, MAX_NH, MAX_HS, VP = 65536, 2048, 64, 1600, 25, 128, 50304
MAX_PARAMS = 1_600_000_000  # d48: 1.56e9 parameters (flat indices of AdamW / the norm: size_t already)
BOUNDS = {
    # sizes (kernel and launcher parameters)
    "N": ROWS * 4 * MAX_C,  # N is rows in most kernels, the element count in the elementwise ones: the larger
    "BT": ROWS, "B": MAX_B, "T": MAX_T, "C": 4 * MAX_C, "OC": 4 * MAX_C, "C3": 3 * MAX_C, "V": VP, "Vp": VP,
    "NH": MAX_NH, "hs": MAX_HS, "HS": MAX_HS, "R": 1024, "U": ROWS, "n": MAX_PARAMS, "units": MAX_PARAMS,
    "rows": ROWS, "rows_per_chunk": ROWS, "VV": VP, "VZ": VP,
    "ROWS": 128,  # attention_tc.cuh's tile rows (a template parameter: 32 .. 128)
    # indices over those sizes
    "row": ROWS, "bt": ROWS, "b": MAX_B, "t": MAX_T, "h": MAX_NH, "c": 4 * MAX_C, "c0": 4 * MAX_C, "r": 1024,
    "r0": ROWS, "r1": ROWS, "u": ROWS, "idx": ROWS * 4 * MAX_C, "i": MAX_PARAMS, "j": MAX_T, "qi": MAX_T,
    "q0": MAX_T, "k0": MAX_T, "key": MAX_T, "ii": MAX_T, "d": MAX_HS, "d0": MAX_HS, "g": 32, "k": 16, "K": 16,
    "lane": 32, "warp": 32, "y": 1024, "e": MAX_HS, "Tn": MAX_T,
    # KV-cache inference (infer.cuh): new tokens per sequence, the cache length, a row of the (S, maxT) cache
    "Tq": MAX_T, "maxT": MAX_T, "S": ROWS,
    # split-key decode: blocks per (head, query, sequence) (kDecodeMaxSplits), a block's index among them and its
    # share of the keys, the GPU's SM count
    "splits": 64, "s": 64, "chunk": MAX_T, "nk": MAX_T, "key0": MAX_T, "sms": 1024,
}
# Names whose meaning differs in one file: there, the file's bound.
FILE_BOUNDS = {
    "classifier.cuh": {"i": VP},      # a column / vector index within one row of logits
    "attention.cuh": {"N": 16},       # attn::Pack<floatX>::N, values per 16-byte pack
}
SIXTY_FOUR = re.compile(r"^(size_t|int64_t|uint64_t|ptrdiff_t|long long)\b|^\(\s*(size_t|int64_t|uint64_t)\s*\)")


def _factor_end(code, i):
    """End of the factor starting at i (an identifier or call, a number, a parenthesised group), or -1."""
    m = re.match(r"\s*", code[i:])
    i += m.end()
    if i >= len(code):
        return -1
    if code[i] == "(":
        depth = 0
        for j in range(i, len(code)):
            depth += {"(": 1, ")": -1}.get(code[j], 0)
            if depth == 0:
                return j + 1
        return -1
    m = re.match(r"[A-Za-z_][\w:]*(?:\.\w+)*|\d+[uUlLfF]*", code[i:])
    if not m:
        return -1
    j = i + m.end()
    if j < len(code) and code[j] == "(":  # a call or a functional cast
        return _factor_end(code, j)
    return j


def product_chains(code):
    """[(start, [factor texts])] of every chain a * b * ... of two or more factors in one line of code."""
    chains, i = [], 0
    starts = [m.start() for m in re.finditer(r"(?<![\w.)\]])[A-Za-z_(0-9]", code)]
    covered = -1
    for s in starts:
        if s < covered:
            continue
        facs, j = [], s
        while True:
            e = _factor_end(code, j)
            if e < 0:
                break
            facs.append(code[j:e].strip())
            m = re.match(r"\s*\*(?![=*])\s*", code[e:])
            if not m or (facs[-1] and re.fullmatch(r"(const\s+)?[A-Za-z_]\w*", facs[-1]) and
                         re.match(r"\s*\*\s*(__restrict__|const\b|[A-Za-z_]\w*\s*[,)=;])", code[e:]) and
                         len(facs) == 1 and re.search(r"(\(|,)\s*(const\s+)?$", code[:j])):
                break  # a pointer declaration `T* p`, not a product
            j = e + m.end()
        if len(facs) >= 2:
            chains.append((s, facs))
            covered = j
    return chains


def bound(factor, bounds):
    """The largest value of a factor at the largest shapes, or None when it is not a size."""
    f = factor.strip()
    if re.fullmatch(r"\d+[uUlL]*", f):
        return int(re.match(r"\d+", f).group(0))
    m = re.fullmatch(r"(?:int|unsigned|size_t|int64_t)\s*\((.*)\)", f) or re.fullmatch(r"\((.*)\)", f)
    if m:
        inner = m.group(1)
        if re.fullmatch(r"[A-Za-z_]\w*", inner.strip()):
            return bounds.get(inner.strip())
        if re.fullmatch(r"[\w\s+*()-]*", inner) and re.search(r"[A-Za-z_]", inner) and not re.search(r"\w\s*\(", inner):
            # sums of products of sizes (no calls)
            expr = re.sub(r"[A-Za-z_]\w*", lambda m: str(bounds.get(m.group(0), 1)), inner).replace("-", "+")
            return eval(expr, {})  # noqa: S307 - digits, +, *, parentheses
        return None
    f = f.replace("blockIdx.x", "R").replace("blockIdx.y", "R")
    return bounds.get(f)


def wide_names(text):
    """Variables and parameters of the file declared 64-bit (size_t, int64_t, uint64_t), by name (file-wide: a name
    declared both ways in one file counts as 64-bit, which the per-file bounds must then keep in mind)."""
    names = set()
    for m in re.finditer(r"\b(?:size_t|int64_t|uint64_t)\s+(?:const\s+)?(\w+)\s*([,)=;])([^;{]*)", text):
        names.add(m.group(1))
        if m.group(2) == "=":  # more declarators in the same statement: `int64_t T = k.T, NH = k.NH;`
            names |= set(re.findall(r",\s*(\w+)\s*=", m.group(3)))
    return names


def is_wide(factor, wide):
    f = factor.strip()
    if SIXTY_FOUR.match(f) or f in wide:
        return True
    m = re.fullmatch(r"\((.*)\)", f)  # a parenthesised expression that starts 64-bit: (size_t(b) * NH + h)
    return bool(m and (SIXTY_FOUR.match(m.group(1).strip()) or m.group(1).split()[0] in wide))


def violations(text, file_bounds=None):
    """[(line, chain, bound)] of the products that can pass 2^31 at the largest shapes in 32-bit arithmetic: the
    part of a chain before its first 64-bit factor is computed in int (C++ evaluates a * b * c as (a * b) * c)."""
    bounds = dict(BOUNDS, **(file_bounds or {}))
    wide = wide_names(text)
    out = []
    for no, line in enumerate(text.splitlines(), 1):
        code = line.split("//")[0]
        for _, facs in product_chains(code):
            prefix = []
            for f in facs:
                if is_wide(f, wide):
                    break
                prefix.append(f)
            bs = [bound(f, bounds) for f in prefix]
            if len(prefix) < 2 or sum(b is not None and not re.fullmatch(r"\d+\w*", f) for b, f in zip(bs, prefix)) < 2:
                continue  # no int product of two sizes
            prod = 1
            for b in bs:
                prod *= b if b is not None else 1
            if prod > INT_MAX:
                out.append((no, " * ".join(facs), prod))
    return out


def kernel_files():
    return sorted(list(CUDA.glob("*.cuh")) + list(CUDA.glob("*.cu")))


def test_the_check_finds_32_bit_products():
    """The check itself: int products of sizes past 2^31 are found, 64-bit ones and small ones are not."""
    assert violations("  const floatX* row = logits + row * Vp;") == [(1, "row * Vp", ROWS * VP)]
    assert violations("  x[row * V + c] = 0;")[0][1] == "row * V"
    assert violations("  x[row * C + c] = 0;") == []  # 65,536 x 6,400 = 4.2e8: int is enough
    assert violations("  out[b * T * Vp + i] = 0;")[0][1] == "b * T * Vp"
    assert violations("  const floatX* row = logits + size_t(n) * Vp;") == []
    assert violations("  size_t idx = 3;\n  y = p[idx * hs];") == []
    assert violations("  const size_t i = 1;\n  q = p + K * i;") == []  # K promoted: i is size_t
    assert violations("  p[(size_t(b) * NH + h) * T * T] = 0;") == []
    assert violations("  p[(b * NH + h) * T * T] = 0;")[0][1] == "(b * NH + h) * T * T"
    assert violations("  const int C = NH * hs;") == []  # 3200 at most
    assert violations("  float y = a * x + b * w;") == []  # not sizes
    assert violations("void f(const float* __restrict__ inp, float* out, int N, int C) {") == []


def test_the_logits_row_offsets_are_checked():
    """Mutants of the products that pass 2^31 first (the classifier's row offsets, 3.3e9 at d12) are found."""
    text = (CUDA / "classifier.cuh").read_text()
    assert text.count("size_t(n) * Vp") == 3
    for k in range(3):
        parts = text.split("size_t(n) * Vp")
        mutated = "size_t(n) * Vp".join(parts[:k + 1]) + "n * Vp" + "size_t(n) * Vp".join(parts[k + 1:])
        assert len(violations(mutated, FILE_BOUNDS["classifier.cuh"])) == 1, k


def test_bounds_cover_the_kernels_sizes():
    """Every int size parameter of a kernel or launcher (int N, int C, ...) has a bound, so its products are checked."""
    names = set()
    for f in kernel_files():
        names |= set(re.findall(r"\bint\s+([A-Z]\w*)\s*[,)]", f.read_text()))
    missing = sorted(n for n in names if n not in BOUNDS)
    assert not missing, f"size parameters without a bound in BOUNDS: {missing}"


def test_index_products_are_64_bit_at_the_largest_shapes():
    found = []
    for f in kernel_files():
        found += [f"{f.name}:{no}: {chain} (up to {b:.3g})"
                  for no, chain, b in violations(f.read_text(), FILE_BOUNDS.get(f.name))]
    assert not found, "32-bit index products that can pass 2^31 at d48, B * T = 65,536:\n" + "\n".join(found)


if __name__ == "__main__":  # every product of sizes with its bound
    for f in kernel_files():
        text = f.read_text()
        for no, line in enumerate(text.splitlines(), 1):
            for _, facs in product_chains(line.split("//")[0]):
                bs = [bound(x, set()) for x in facs]
                if sum(b is not None and not re.fullmatch(r"\d+\w*", x) for b, x in zip(bs, facs)) >= 2:
                    p = 1
                    for b in bs:
                        p *= b or 1
                    print(f"{f.name}:{no}: {' * '.join(facs):40s} {p:.3g} {'64-bit' if SIXTY_FOUR.match(facs[0]) else ''}")
    sys.exit(0)
