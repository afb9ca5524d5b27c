"""llama.cpp beside the core in `scripts/bench.py --generate` (imported by bench_generate.py).

The model the benchmark runs is exported through the project's Hugging Face export (GPT2.save_pretrained, plus
the GPT-2 tokenizer files gpt2core ships: encoder.json = vocab.json, vocab.bpe = merges.txt, which llama.cpp's
converter reads), converted by llama.cpp's own converter (convert_hf_to_gguf.py, --outtype f32 / f16 / q8_0) and
run through llama-cpp-python's Llama with the same prompt ids, batch 1, the same threads, greedy decoding.

The converter is not installed with llama-cpp-python: it ships in its source distribution under vendor/llama.cpp
(with the conversion/ package and gguf-py/ it imports). It is taken from --llama-cpp-dir when given, else from the
sdist of the installed llama-cpp-python version, fetched once with `pip download --no-binary :all: --no-deps`
and unpacked (those three parts only) into the cache folder. Converted files are cached too, keyed by the
model's weights and configuration (model_key) and the converter's version, so reruns do not convert again:

    $XDG_CACHE_HOME/gpt2core/bench/  (default ~/.cache/gpt2core/bench/)
        llama.cpp-<version>/convert_hf_to_gguf.py, conversion/, gguf-py/
        gguf-<model key>-<version>/model-f32.gguf, model-f16.gguf, model-q8_0.gguf
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

GGUF_TYPES = ("f32", "f16", "q8_0")
# the llama.cpp weights each of the core's inference weights is compared with
OURS_TO_GGUF = {"fp32": "f32", "bf16": "f16", "fp16": "f16", "q8": "q8_0", "int8": "q8_0"}
_CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def cache_root() -> Path:
    """$XDG_CACHE_HOME/gpt2core/bench (~/.cache/gpt2core/bench): where bench.py keeps what it measures once."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpt2core" / "bench"


def model_key(config, flat_params) -> str:
    """16 hex digits of sha256 over the configuration (its fields, sorted) and the fp32 parameter bytes: the
    same weights give the same key whatever the process, any changed weight or field another."""
    h = hashlib.sha256()
    fields = config.__dict__ if hasattr(config, "__dict__") else dict(config)
    h.update(json.dumps(fields, sort_keys=True, default=str).encode())
    h.update(np.ascontiguousarray(flat_params, dtype=np.float32).tobytes())
    return h.hexdigest()[:16]


def gguf_paths(folder: Path, types=GGUF_TYPES) -> dict[str, Path]:
    return {t: Path(folder) / f"model-{t}.gguf" for t in types}


def export_hf(model, folder) -> Path:
    """The project's Hugging Face export of `model` into folder, with the GPT-2 tokenizer files gpt2core ships
    (the converter reads the vocabulary; the benchmark feeds token ids)."""
    from gpt2core import tokenizer
    folder = Path(folder)
    model.save_pretrained(folder)
    shutil.copyfile(tokenizer.ASSETS / "encoder.json", folder / "vocab.json")
    shutil.copyfile(tokenizer.ASSETS / "vocab.bpe", folder / "merges.txt")
    return folder


def _sdist_members(names):
    """(member name, path under vendor/llama.cpp) of the converter's parts in an sdist's member list."""
    out = []
    for n in names:
        i = n.find("/vendor/llama.cpp/")
        if i < 0:
            continue
        rel = n[i + len("/vendor/llama.cpp/"):]
        if any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in _CONVERTER_PARTS):
            out.append((n, rel))
    return out


def find_converter(version: str, llama_cpp_dir=None, root: Path | None = None, log=print) -> Path:
    """convert_hf_to_gguf.py of llama.cpp: in llama_cpp_dir when given, else the one unpacked from the sdist of
    llama-cpp-python `version` in the cache (fetched from PyPI the first time). Raises RuntimeError naming what
    to do when neither works."""
    if llama_cpp_dir is not None:
        p = Path(llama_cpp_dir) / "convert_hf_to_gguf.py"
        if not p.is_file():
            raise RuntimeError(f"--llama-cpp-dir {llama_cpp_dir}: no convert_hf_to_gguf.py there")
        return p
    dest = (root or cache_root()) / f"llama.cpp-{version}"
    conv = dest / "convert_hf_to_gguf.py"
    if conv.is_file():
        return conv
    with tempfile.TemporaryDirectory(prefix="gpt2core-llama-sdist-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-q",
               f"llama-cpp-python=={version}", "-d", tmp]
        log(f"llama.cpp's converter: fetching the llama-cpp-python {version} sdist ({' '.join(cmd[2:])})")
        p = subprocess.run(cmd, capture_output=True, text=True)
        sdists = list(Path(tmp).glob("*.tar.gz"))
        if p.returncode != 0 or not sdists:
            raise RuntimeError(f"cannot fetch the llama-cpp-python {version} sdist for its convert_hf_to_gguf.py "
                               f"({(p.stderr or p.stdout).strip().splitlines()[-1:] or 'no file'}); pass "
                               "--llama-cpp-dir DIR (a llama.cpp checkout)")
        part = Path(tempfile.mkdtemp(prefix=f"llama.cpp-{version}.", dir=_mkdir(dest.parent)))
        with tarfile.open(sdists[0]) as tf:
            members = _sdist_members(tf.getnames())
            if not any(rel == "convert_hf_to_gguf.py" for _, rel in members):
                raise RuntimeError(f"{sdists[0].name}: no vendor/llama.cpp/convert_hf_to_gguf.py inside; pass "
                                   "--llama-cpp-dir DIR")
            for name, rel in members:
                m = tf.getmember(name)
                if not (m.isfile() or m.isdir()):
                    continue
                target = part / rel
                if m.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with tf.extractfile(m) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        try:
            part.rename(dest)  # whole or not at all (another process may have won the race: use its copy)
        except OSError:
            shutil.rmtree(part, ignore_errors=True)
    return conv


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def convert(model, key: str, types, converter: Path, version: str, root: Path | None = None,
            log=print) -> dict[str, Path]:
    """GGUF files of `model` (whose model_key is `key`) for each llama.cpp type in `types`, converted by
    `converter` from the Hugging Face export once and then read from the cache."""
    folder = _mkdir((root or cache_root()) / f"gguf-{key}-{version}")
    paths = gguf_paths(folder, types)
    missing = [t for t, p in paths.items() if not p.is_file()]
    if not missing:
        return paths
    with tempfile.TemporaryDirectory(prefix="gpt2core-bench-hf-") as tmp:
        export_hf(model, tmp)
        for t in missing:
            part = paths[t].with_suffix(".gguf.part")
            cmd = [sys.executable, str(converter), tmp, "--outtype", t, "--outfile", str(part),
                   "--model-name", f"gpt2core-{key}"]
            t0 = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0 or not part.is_file():
                tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-5:])
                raise RuntimeError(f"llama.cpp's converter failed for --outtype {t} ({converter}):\n{tail}")
            part.rename(paths[t])
            log(f"converted to GGUF {t.upper()} in {time.perf_counter() - t0:.0f} s: {paths[t]}")
    return paths


def time_llamacpp(path, prompt, new: int, threads: int, warmup: bool = True):
    """(prefill ms, decode tokens/s, greedy ids) of llama.cpp on one prompt of token ids: the prompt in one
    llama_decode (its logits at the last position only), llama.cpp's greedy sampler, then `new` decode steps of
    one token each, each followed by the sampler (new + 1 ids in all, the first from the prefill)."""
    import llama_cpp
    prompt = [int(t) for t in prompt]
    P = len(prompt)
    n_batch = max(512, P)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=P + new + 8, n_batch=n_batch, n_ubatch=n_batch,
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    smpl = llama_cpp.llama_sampler_init_greedy()
    try:
        def run(n):
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(prompt)
            ids = [llama_cpp.llama_sampler_sample(smpl, llm.ctx, -1)]
            t1 = time.perf_counter()
            for _ in range(n):
                llm.eval(ids[-1:])
                ids.append(llama_cpp.llama_sampler_sample(smpl, llm.ctx, -1))
            t2 = time.perf_counter()
            return t1 - t0, t2 - t1, ids
        if warmup:
            run(2)
        pre, dec, ids = run(new)
    finally:
        llama_cpp.llama_sampler_free(smpl)
        llm.close() if hasattr(llm, "close") else None
    return 1e3 * pre, new / dec, np.asarray(ids, dtype=np.int64)


def common_prefix(a, b) -> int:
    """How many leading ids a and b share."""
    n = min(len(a), len(b))
    a, b = np.asarray(a[:n]), np.asarray(b[:n])
    d = np.flatnonzero(a != b)
    return int(d[0]) if d.size else n
