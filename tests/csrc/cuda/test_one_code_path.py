"""One code path for the emulator and the GPU: the production CUDA sources (csrc/cuda, and csrc/model, whose clip
rule and loss scaler the kernels call) compile the same expressions under g++ against the emulator as under nvcc,
except for the lines listed in nvcc_only_lines.txt, each group with its reason and its independent check in
NVCC_ONLY below. The test fails when a line the emulator does not compile appears unlisted (a new `#if __CUDACC__`
/ `__CUDA_ARCH__` / `GPT2CORE_EMU` branch, inline PTX, a library call), when a listed line is gone (so the list
stays exact), and when a source file of csrc/cuda that the emulated build never includes appears unlisted.

What counts as compiled by the emulator: a line outside every preprocessor conditional that names __CUDACC__,
__CUDA_ARCH__, GPT2CORE_EMU (or the macros defined inside such a branch), or inside a branch whose condition holds
with GPT2CORE_EMU = 1 and neither __CUDACC__ nor __CUDA_ARCH__ defined (the emulated build's configuration, csrc/emu).
Comment and blank lines are ignored.

    python tests/csrc/cuda/test_one_code_path.py   # prints the current listing (review it, then keep the header)
"""
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CSRC = ROOT / "csrc"
LISTING = Path(__file__).with_name("nvcc_only_lines.txt")
SCANNED = ["cuda/*.cuh", "cuda/*.cu", "cuda/*.h", "cuda/*.cpp", "model/*.h", "model/*.cpp"]
EMU_ROOTS = ["cuda/backend_cuda.cu", "cuda/plugin.cpp"]  # what the emulated module compiles from csrc/cuda
TOOLCHAIN = {"__CUDACC__", "__CUDA_ARCH__", "GPT2CORE_EMU", "GPT2_SM75"}
EMU_DEFINES = {"GPT2CORE_EMU": 1}

# Every group of nvcc-only lines: why it stays nvcc-only, and what checks it against an independent semantics.
NVCC_ONLY = {
    "cuda/portable.h": ("the toolchain switch itself: CUDA's headers, <<<>>> and extern __shared__ under nvcc (the "
                        "emulator provides LAUNCH, DYNAMIC_SMEM and the headers' API)",
                        "every emulator test launches through LAUNCH / DYNAMIC_SMEM; nvcc compiles the real ones in "
                        "CI's build (GPT2CORE_CUDA_ARCHS 75;90)"),
    "model/host_device.h": ("__host__ __device__ on the clip rule and the loss scaler's step (one body, std:: math)",
                            "the bodies are compiled by both (no branch); compare_ops.py checks them against "
                            "GradScaler's rule and the clip rule written out"),
    "cuda/mma.cuh": ("inline PTX: mma.sync m16n8k16 / m16n8k8 and ldmatrix .x4 (.trans); below sm_75/sm_80 a trap "
                     "or the k8 split", "tests/csrc/emu/mma.cu: the emulator's fragment layouts (PTX ISA) against a "
                     "float64 product; test_cuda_gpu.py runs the PTX on a GPU against the emulated kernels"),
    "cuda/attention_tc.cuh": ("tc_arch_runs: which head sizes an architecture below sm_80 compiles; kTcSm75: the "
                              "backward's minimum blocks per SM in its launch bounds below sm_80",
                              "test_cuda_gpu.py (GPU) against attention_tc_fits, which picks the kernels on the host; "
                              "check_cuda_compile.py / kernel_resources.py read ptxas's report for every arch built"),
    "cuda/cp_async.cuh": ("inline PTX: cp.async (16 and 4 bytes, src-size zero fill), commit_group, wait_group, "
                          "wait_all; below sm_80 plain copies",
                          "tests/csrc/emu/cp_async.cu: the emulator's cp.async against the PTX ISA's group rules "
                          "(poisoned until the wait; planted missing waits and barriers fail); test_cuda_gpu.py runs "
                          "the PTX on a GPU against the emulated kernels"),
    "cuda/matmul.cuh": ("cuBLASLt's last error message (library call)", "test_cublaslt_descriptors.py"),
    "cuda/fp8.cuh": ("the hardware's cvt.rn.satfinite (cuda_fp8.h's __nv_cvt_float_to_fp8) on sm_89 / sm_90, where "
                     "the emulator runs model/fp8.h's conversion", "tests/csrc/cuda/test_fp8.py: model/fp8.h against "
                     "ml_dtypes and against cuda_fp8.h's own host conversion (NVIDIA's statement of the instruction), "
                     "bit for bit; check_cuda_compile.py builds fp8_instantiations.cu for sm_89 / sm_90"),
    "cuda/layernorm.cuh": ("the layernorm backward's minimum blocks per SM in its launch bounds on sm_75 (1024 threads "
                           "per SM): a per-architecture compile-time constant", "check_cuda_compile.py / "
                           "test_launch_bounds.py read ptxas's report for every arch built"),
    "cuda/backend_cuda.cu": ("library calls: cuDNN's seam header, the library workspaces per stream, cuBLASLt / cuDNN "
                             "error messages (with the arch advice for a device the build has no code for), cudaSetDevice / "
                             "cudaFuncGetAttributes of a real device",
                             "test_cuda_gpu.py and test_cudnn_graph.py on a GPU; test_cuda_emu.py's device-error test "
                             "for the real build without a GPU"),
}
# Files of csrc/cuda the emulated build never includes: the library seams (cuBLASLt, cuDNN), served in the emulator
# by csrc/emu/seams_cpu.cpp behind the same csrc/cuda/seams.h.
NVCC_ONLY_FILES = {
    "cuda/seams_cublaslt.cu": "cuBLASLt calls; descriptors checked by test_cublaslt_descriptors.py",
    "cuda/seams_cublaslt.h": "cuBLASLt seam declarations",
    "cuda/seams_cublaslt_call.h": "cuBLASLt call helpers; test_cublaslt_descriptors.py",
    "cuda/seams_cudnn.cu": "cuDNN frontend calls; test_cudnn_graph.py",
    "cuda/seams_cudnn.h": "cuDNN seam declarations",
    "cuda/seams_cudnn_graph.h": "cuDNN graph description; test_cudnn_graph.py",
    "cuda/matmul_algo_choice.h": "cuBLASLt algorithm choice; test_matmul_algo_choice.py (host)",
    "cuda/seams_check.h": "the GPU seams' error handling; tests/csrc/emu/seams.cpp (host)",
}


def _emu_value(cond):
    """The value of a #if / #elif condition in the emulated build (undefined macros are 0, as the preprocessor)."""
    e = re.sub(r"defined\s*\(\s*(\w+)\s*\)|defined\s+(\w+)",
               lambda m: "1" if (m.group(1) or m.group(2)) in EMU_DEFINES else "0", cond)
    e = re.sub(r"//.*|/\*.*?\*/", "", e)
    e = re.sub(r"[A-Za-z_]\w*", lambda m: str(EMU_DEFINES.get(m.group(0), 0)), e)
    e = e.replace("&&", " and ").replace("||", " or ")
    e = re.sub(r"!(?!=)", " not ", e)
    return bool(eval(e, {}))  # noqa: S307 - preprocessor arithmetic of our own sources


def nvcc_only(text):
    """[(line number, stripped line)] the emulated build does not compile, and the macros defined in them."""
    out, stack = [], []  # stack: [toolchain conditional?, a branch taken so far (emu), this branch excluded (emu)]
    toolchain = set(TOOLCHAIN)
    in_comment = False
    for i, raw in enumerate(text.splitlines(), 1):
        s = raw.strip()
        if in_comment:
            in_comment = "*/" not in s
            continue
        if s.startswith("/*"):
            in_comment = "*/" not in s
            continue
        d = re.match(r"#\s*(if|ifdef|ifndef|elif|else|endif)\b(.*)", s)
        if d:  # a directive is nvcc-only when a branch around its conditional is
            kind, cond = d.group(1), d.group(2).strip()
            opening = kind in ("if", "ifdef", "ifndef")
            if any(f[2] for f in (stack if opening else stack[:-1])):
                out.append((i, s))
            if kind == "ifdef":
                cond = f"defined({cond})"
            elif kind == "ifndef":
                cond = f"!defined({cond})"
            if opening:
                tc = bool(set(re.findall(r"\w+", cond)) & toolchain)
                val = _emu_value(cond) if tc else True
                stack.append([tc, val, tc and not val])
            elif kind == "elif":
                f = stack[-1]
                tc = f[0] or bool(set(re.findall(r"\w+", cond)) & toolchain)
                val = (not f[1]) and (_emu_value(cond) if tc else True)
                f[0], f[2], f[1] = tc, tc and not val, f[1] or val
            elif kind == "else":
                f = stack[-1]
                f[2] = f[0] and f[1]
                f[1] = True
            else:
                stack.pop()
            continue
        excluded = any(f[2] for f in stack)
        if excluded and s and not s.startswith("//"):
            out.append((i, s))
            m = re.match(r"#\s*define\s+(\w+)", s)
            if m:
                toolchain.add(m.group(1))
        elif re.search(r"\basm\b", s.split("//")[0]):
            out.append((i, s))  # inline PTX compiled by g++: g++ would reject it, but list it anyway
    return out


def emulated_files():
    """Files of csrc/cuda and csrc/model the emulated build includes (the include closure of EMU_ROOTS, skipping
    #includes in nvcc-only branches)."""
    seen, todo = set(), list(EMU_ROOTS)
    while todo:
        rel = todo.pop()
        if rel in seen or not (CSRC / rel).exists():
            continue
        seen.add(rel)
        text = (CSRC / rel).read_text()
        skipped = {i for i, _ in nvcc_only(text)}
        for i, line in enumerate(text.splitlines(), 1):
            m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
            if m and i not in skipped:
                inc = m.group(1)
                todo.append(inc if (CSRC / inc).exists() else str(Path(rel).parent / inc))
    return seen


def scanned_files():
    return sorted({str(p.relative_to(CSRC)) for g in SCANNED for p in CSRC.glob(g)})


def listing():
    """The current nvcc-only lines as 'file: line' strings."""
    out = []
    for rel in scanned_files():
        if rel in NVCC_ONLY_FILES:
            continue
        out += [f"{rel}: {s}" for _, s in nvcc_only((CSRC / rel).read_text())]
    return out


def read_listing():
    return [line for line in LISTING.read_text().splitlines() if line.strip() and not line.startswith("#")]


def test_preprocessor_evaluation():
    assert nvcc_only("#if defined(__CUDACC__)\na\n#else\nb\n#endif\n") == [(2, "a")]
    assert [s for _, s in nvcc_only("#if !GPT2CORE_EMU\na\n#endif\nb\n")] == ["a"]
    assert [s for _, s in nvcc_only("#if GPT2CORE_EMU\na\n#else\nb\n#if X\nc\n#endif\n#endif\nd\n")] == \
        ["b", "#if X", "c", "#endif"]
    assert [s for _, s in nvcc_only("x = 1;  // asm in a comment\n#if 0\n#endif\n")] == []
    assert [s for _, s in nvcc_only("#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 750\na\n#elif "
                                    "defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800\nb\n#else\nc\n#endif\n")] == ["a", "b"]
    assert [s for _, s in nvcc_only("#ifdef FOO\na\n#endif\n#ifndef __CUDACC__\nb\n#else\nc\n#endif\n")] == ["c"]


def test_no_unlisted_nvcc_only_line():
    found, listed = Counter(listing()), Counter(read_listing())
    new, gone = found - listed, listed - found
    assert not new, ("lines the emulator does not compile (nvcc only) appeared; reduce them to one code path "
                     "(std:: math, csrc/cuda/portable.h) or list them in tests/csrc/cuda/nvcc_only_lines.txt with "
                     "an independent check in NVCC_ONLY:\n" + "\n".join(sorted(new)))
    assert not gone, "listed nvcc-only lines no longer exist (remove them from the listing):\n" + "\n".join(sorted(gone))


def test_every_nvcc_only_group_has_a_reason_and_a_check():
    files = {line.split(":", 1)[0] for line in listing()}
    assert files <= set(NVCC_ONLY), f"nvcc-only lines in files without a reason: {sorted(files - set(NVCC_ONLY))}"
    assert set(NVCC_ONLY) <= files | {"model/host_device.h"}, "stale NVCC_ONLY entries"


def test_every_cuda_file_is_emulated_or_listed():
    emulated = emulated_files()
    assert "cuda/reduce.cuh" in emulated and "model/optimizer.h" in emulated  # the closure is followed
    cuda_files = {f for f in scanned_files() if f.startswith("cuda/")}
    missing = cuda_files - emulated - set(NVCC_ONLY_FILES)
    assert not missing, f"csrc/cuda files the emulated build never compiles, unlisted: {sorted(missing)}"
    assert not (set(NVCC_ONLY_FILES) & emulated), "listed as nvcc-only but the emulator compiles them"


def test_model_layer_has_one_code_path():
    """The loss scaler's overflow check and the clip rule: no toolchain branch left in csrc/model except the one
    GPT2CORE_HOST_DEVICE macro, so a device-only `!isinf` (NaN counted as clean) cannot hide from the tests."""
    lines = [line for line in listing() if line.startswith("model/")]
    assert all(line.startswith("model/host_device.h: ") for line in lines), lines
    text = (CSRC / "model" / "optimizer.h").read_text()
    assert "::isfinite" not in text.replace("std::isfinite", "") and "__CUDACC__" not in text


if __name__ == "__main__":
    print("\n".join(listing()))
    sys.exit(0)
