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
            how = "llama.cpp's converter"
            if p.returncode != 0 and "No module named 'torch'" in (p.stderr or ""):
                # the converter reads checkpoints through torch; without it, its GGUF library writes the file
                write_gguf(model, part, t, Path(converter).parent / "gguf-py")
                how = "llama.cpp's gguf-py (its converter needs torch, not installed)"
            elif p.returncode != 0 or not part.is_file():
                tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-5:])
                raise RuntimeError(f"llama.cpp's converter failed for --outtype {t} ({converter}):\n{tail}")
            part.rename(paths[t])
            log(f"converted to GGUF {t.upper()} by {how} in {time.perf_counter() - t0:.0f} s: {paths[t]}")
    return paths


def write_gguf(model, path, outtype: str, gguf_py) -> Path:
    """`model` as a GGUF file of llama.cpp's gpt2 architecture, written with llama.cpp's own GGUF library (gguf-py,
    the `gguf_py` folder: the copy unpacked beside the converter, so file and reader are of one version). What
    convert_hf_to_gguf.py writes for GPT-2 (conversion/gpt2.py), without the torch it needs to read a Hugging Face
    checkpoint: the same keys, tensor names and layouts (llm.c's matrices are already (out, in), what the converter
    transposes Conv1D's into), the GPT-2 vocabulary and merges, and the converter's choice of types (q8_0: every
    matrix but the position embedding; f16: every matrix; norms and biases f32). The tied head is left out:
    llama.cpp uses token_embd for it, as for a converted GPT-2."""
    import importlib
    if str(gguf_py) not in sys.path:
        sys.path.insert(0, str(gguf_py))
    gguf = importlib.import_module("gguf")
    from gpt2core import tokenizer
    c = model.config
    if (c.position, c.norm, c.activation, c.bias, c.tie_embeddings, c.qk_norm) != \
            ("learned", "layernorm", "gelu", True, True, False):
        raise ValueError("write_gguf: llama.cpp's gpt2 architecture is the 2019 GPT-2 (learned positions, "
                         "LayerNorm, GELU, biases, tied head); this model's configuration is another")
    qtype = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "q8_0": gguf.GGMLQuantizationType.Q8_0}[outtype]
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_name("gpt2core")
    w.add_block_count(c.n_layer)
    w.add_context_length(c.block_size)
    w.add_embedding_length(c.n_embd)
    w.add_feed_forward_length(4 * c.n_embd)
    w.add_head_count(c.n_head)
    w.add_layer_norm_eps(1e-5)
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype])
    enc = json.loads((tokenizer.ASSETS / "encoder.json").read_text(encoding="utf-8"))
    tokens = [t for t, _ in sorted(enc.items(), key=lambda kv: kv[1])][:c.vocab_size]
    merges = [ln for ln in (tokenizer.ASSETS / "vocab.bpe").read_text(encoding="utf-8").splitlines()[1:] if ln]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t == "<|endoftext|>" else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    eot = enc["<|endoftext|>"]
    w.add_bos_token_id(eot)
    w.add_eos_token_id(eot)
    P = {k: np.asarray(v, dtype=np.float32) for k, v in model.params.items()}

    def add(name, a, matrix=False):
        a = np.ascontiguousarray(a, dtype=np.float32)
        t = qtype if matrix else gguf.GGMLQuantizationType.F32
        if t == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        elif t == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            try:
                w.add_tensor(name, gguf.quants.quantize(a, t), raw_dtype=t)
            except gguf.QuantError:  # a row not a multiple of the block (32): f16, as the converter falls back
                w.add_tensor(name, a.astype(np.float16))

    add("token_embd.weight", P["wte"][:c.vocab_size], matrix=True)
    add("position_embd.weight", P["wpe"], matrix=outtype == "f16")  # q8_0 keeps positions in f32 (converter)
    layer = {"attn_norm.weight": "ln1w", "attn_norm.bias": "ln1b", "attn_qkv.weight": "qkvw", "attn_qkv.bias": "qkvb",
             "attn_output.weight": "attprojw", "attn_output.bias": "attprojb", "ffn_norm.weight": "ln2w",
             "ffn_norm.bias": "ln2b", "ffn_up.weight": "fcw", "ffn_up.bias": "fcb", "ffn_down.weight": "fcprojw",
             "ffn_down.bias": "fcprojb"}
    for i in range(c.n_layer):
        for name, ours in layer.items():
            add(f"blk.{i}.{name}", P[ours][i], matrix=P[ours][i].ndim == 2)
    add("output_norm.weight", P["lnfw"])
    add("output_norm.bias", P["lnfb"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


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
