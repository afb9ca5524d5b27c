"""FineWeb-Edu (or FineWeb) -> GPT-2 token shards in llm.c's format.

Where the data comes from
    Hugging Face ``HuggingFaceFW/fineweb-edu`` (ODC-By 1.0), config ``sample-10BT`` by default
    (``--sample 100BT`` / ``350BT`` for the bigger samples, ``--dataset fineweb`` for plain
    ``HuggingFaceFW/fineweb``). Read through ``datasets`` if installed, else the parquet files are fetched
    with ``huggingface_hub`` (``pip install 'gpt2core[data]'``). Offline, pass local files with
    ``--input``: JSON Lines with a ``text`` field (``.jsonl``, ``.json``, ``.jsonl.gz``), parquet (needs
    pyarrow) or plain text (``.txt``, one document per file); directories are searched for such files.

One record (FineWeb-Edu, text shortened):
    {"text": "Lord British was killed during an in-game appearance on Ultima Online's beta test on
    August 8, 1997. ...", "id": "<urn:uuid:254fdcc9-84ad-4754-8abe-c3afb3c20a3f>", "dump": "CC-MAIN-...",
    "url": "...", "language": "en", "token_count": ..., "score": ..., "int_score": ...}

What it does
    Every document becomes ``<|endoftext|>`` (50256) followed by its GPT-2 tokens, empty and
    whitespace-only ones too (a lone 50256, or 50256 and the whitespace's tokens), as llm.c's
    ``dev/data/fineweb.py`` writes them: the same documents give the same shards, byte for byte.
    A process pool tokenizes; the token stream is cut into shards of ``--shard-size`` tokens (1e8 by
    default, the last one shorter). Shard 0 is validation: ``edufineweb_val_000000.bin``, then
    ``edufineweb_train_000001.bin``, ... Each shard is written to a temporary name and renamed, and
    ``<name>_manifest.json`` records after each shard where the next one starts, so an interrupted run,
    started again with the same command, keeps the finished shards and carries on from there.

Commands and what they produce
    python -m gpt2core.data fineweb --num-procs 16          # into data/edu_fineweb10B
        about 10B tokens in about 100 shards (edufineweb_val_000000.bin, then edufineweb_train_000001.bin
        ...; 1e8 tokens = 200 MB each), about 20 GB. The Hub download (tens of GB of parquet) is cached by
        datasets. Tokenizing costs about 0.5 us of CPU per token (2.3M tokens/s with 1 process, 3.8M with 2,
        measured on a 2-core machine), so 10B tokens take minutes, not hours, with 16 processes.
    python -m gpt2core.data fineweb --input ../shared/data/fineweb/fineweb_10BT_sample300.jsonl \\
        --out-dir /tmp/fw300 --shard-size 100000
        300 documents, 496,714 tokens: edufineweb_val_000000.bin and edufineweb_train_000001..000004.bin
        (100,000 tokens each, the last 96,714).
"""
from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

from ..formats.atomic import atomic_write
from .. import cli
from ..errors import Error
from ..formats.runlock import RunLock
from .shards import check_name, parse_shard_filename, read_header, shard_filename, write_shard

EOT = 50256
DATASETS = {"edu": "HuggingFaceFW/fineweb-edu", "fineweb": "HuggingFaceFW/fineweb"}
DEFAULT_NAMES = {"edu": "edufineweb", "fineweb": "fineweb"}
LOCAL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet", ".txt")
MANIFEST_VERSION = 1
CHUNK_CHARS = 1 << 18      # documents are sent to workers in chunks of about this many characters
MAX_SHARD = 2**31 - 1      # the header stores the count as int32


class InputError(Error, ValueError):
    """Input that cannot be turned into tokens; the message names the file (and line)."""


# ------------------------------------------------------------------------------------ documents
def _local_files(inputs) -> list[Path]:
    files = []
    for inp in inputs:
        p = Path(inp)
        if p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.is_file() and q.name.endswith(LOCAL_SUFFIXES))
            if not found:
                raise InputError(f"{p}: no input files ({', '.join(LOCAL_SUFFIXES)}) in this directory")
            files += found
        elif p.is_file():
            if not p.name.endswith(LOCAL_SUFFIXES):
                raise InputError(f"{p}: unsupported input type; use one of {', '.join(LOCAL_SUFFIXES)}")
            files.append(p)
        else:
            raise InputError(f"{p}: no such file or directory")
    return files


def _decode(raw: bytes, path, line, errors: str) -> str:
    try:
        return raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        if not line:
            line = raw.count(b"\n", 0, e.start) + 1
        where = f"line {line}, "
        raise InputError(
            f"{path}: {where}byte offset {e.start}: invalid UTF-8 (byte 0x{raw[e.start]:02x}); fix the file "
            "or pass --utf8-errors replace to substitute U+FFFD") from None


def _iter_jsonl(path: Path, text_field: str, errors: str):
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            line = _decode(raw, path, lineno, errors)
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}: line {lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict) or text_field not in rec:
                fields = ", ".join(rec) if isinstance(rec, dict) else type(rec).__name__
                raise InputError(f"{path}: line {lineno}: no {text_field!r} field (has: {fields}); "
                                 "choose the field with --text-field")
            text = rec[text_field]
            if text is None:
                text = ""
            if not isinstance(text, str):
                raise InputError(f"{path}: line {lineno}: field {text_field!r} is a "
                                 f"{type(text).__name__}, not a string")
            yield text


def _iter_parquet(path: Path, text_field: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), or convert the "
                         "file to JSON Lines") from None
    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if text_field not in names:
        raise InputError(f"{path}: no column {text_field!r} (has: {', '.join(names)}); "
                         "choose it with --text-field")
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            yield "" if text is None else text


def iter_local_documents(inputs, text_field: str = "text", utf8_errors: str = "strict"):
    """The documents (str) of local jsonl / parquet / txt files, in order."""
    for path in _local_files(inputs):
        name = path.name
        if name.endswith(".parquet"):
            yield from _iter_parquet(path, text_field)
        elif name.endswith(".txt"):
            yield _decode(path.read_bytes(), path, None, utf8_errors)
        else:
            yield from _iter_jsonl(path, text_field, utf8_errors)


def iter_hf_documents(dataset: str = "edu", sample: str = "10BT", text_field: str = "text",
                      cache_dir=None):
    """Documents of FineWeb(-Edu) from the Hugging Face Hub (downloaded and cached on first use).
    The download happens here, so a missing package or network fails before anything is written;
    the returned iterator yields the texts."""
    repo, config = DATASETS[dataset], f"sample-{sample}"
    hint = ("; without network access, download the parquet files elsewhere and pass them (or jsonl/txt "
            "files) with --input")
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None:
        try:
            ds = datasets.load_dataset(repo, name=config, split="train", cache_dir=cache_dir)
        except Exception as e:  # network, auth, disk: all end here
            raise RuntimeError(f"could not load {repo} ({config}) with datasets: {e}{hint}") from e
        if hasattr(ds, "select_columns"):
            ds = ds.select_columns([text_field])

        def rows():
            for batch in ds.iter(batch_size=1024):
                for text in batch[text_field]:
                    yield "" if text is None else text
        return rows()
    try:
        import huggingface_hub
    except ImportError:
        raise RuntimeError("downloading FineWeb needs `datasets` or `huggingface_hub` "
                           f"(pip install 'gpt2core[data]'){hint}") from None
    pattern = f"sample/{sample}/*.parquet"
    try:
        root = huggingface_hub.snapshot_download(repo, repo_type="dataset", allow_patterns=[pattern],
                                                 cache_dir=cache_dir)
    except Exception as e:
        raise RuntimeError(f"could not download {repo} {pattern} with huggingface_hub: {e}{hint}") from e
    files = sorted(Path(root).glob(pattern))
    if not files:
        raise RuntimeError(f"{repo}: no files match {pattern} in {root}")
    return (text for path in files for text in _iter_parquet(path, text_field))


# ------------------------------------------------------------------------------------ tokenizing
_ENC = None


def _init_worker():
    global _ENC
    from ..tokenizer import get_encoding
    _ENC = get_encoding()


def tokenize_chunk(texts):
    """Tokens of a list of documents: (uint16 array of [EOT, doc tokens...] for each document,
    concatenated; int64 array of each document's token count, EOT included)."""
    if _ENC is None:
        _init_worker()
    parts, lens = [], np.zeros(len(texts), dtype=np.int64)
    for i, text in enumerate(texts):
        toks = np.array([EOT] + _ENC.encode_ordinary(text), dtype=np.int64)
        hi = int(toks.max())
        if hi > 65535:
            raise InputError(f"token id {hi} does not fit in uint16 (0..65535): the shard format stores "
                             "uint16 tokens, so the vocabulary must have at most 65,536 entries")
        parts.append(toks.astype(np.uint16))
        lens[i] = toks.size
    out = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)
    return out, lens


def _chunks(docs, chunk_chars: int):
    chunk, size = [], 0
    for text in docs:
        chunk.append(text)
        size += len(text)
        if size >= chunk_chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _tokenized(docs, num_procs: int, chunk_chars: int):
    """(tokens, lens, texts_count) per chunk, in order; at most a few chunks in flight (the input is
    not read ahead further than needed, unlike Pool.imap)."""
    chunks = _chunks(docs, chunk_chars)
    if num_procs <= 1:
        for c in chunks:
            yield tokenize_chunk(c)
        return
    import multiprocessing as mp
    with mp.Pool(num_procs, initializer=_init_worker) as pool:
        pending = deque()
        for c in chunks:
            pending.append(pool.apply_async(tokenize_chunk, (c,)))
            if len(pending) >= 2 * num_procs + 2:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# ------------------------------------------------------------------------------------ shards
def shard_path(out_dir, name: str, index: int) -> Path:
    return Path(out_dir) / shard_filename(name, index)


def _shards_of(out_dir: Path, name: str, suffix: str = "") -> list[Path]:
    """The shard files (+ suffix) of data set `name` in out_dir; not those of a name that starts like it."""
    return sorted(p for p in out_dir.glob(f"*.bin{suffix}")
                  if (s := parse_shard_filename(p.name[:len(p.name) - len(suffix)])) and s[0] == name)


def _write_json_atomic(path: Path, obj):
    with atomic_write(path, "w") as f:
        json.dump(obj, f, indent=1)


def _resume_point(manifest_path: Path, settings: dict, out_dir: Path):
    """Shards of an earlier run with the same settings that are still intact, in order."""
    if not manifest_path.exists():
        return None
    try:
        m = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"{manifest_path}: unreadable manifest ({e}); delete it or use --overwrite") from None
    if m.get("settings") != settings:
        raise InputError(
            f"{out_dir} holds shards made with other settings ({manifest_path} says {m.get('settings')}, "
            f"this run is {settings}); use another --out-dir, or --overwrite to replace them")
    kept = []
    for s in m.get("shards", []):
        p = out_dir / s["file"]
        try:
            ok = read_header(p) == s["n_tokens"]
        except Exception:
            ok = False
        if not ok:
            break
        kept.append(s)
    return {"shards": kept, "complete": bool(m.get("complete")) and len(kept) == len(m["shards"]),
            "stats": m.get("stats", {})}


def write_shards(docs, out_dir, name: str = "edufineweb", shard_size: int = 10**8, num_procs: int = 1,
                 settings: dict | None = None, overwrite: bool = False, progress: bool = True,
                 chunk_chars: int = CHUNK_CHARS, log=print) -> dict:
    """Tokenize the documents of the iterable `docs` into shards in `out_dir` (see the module doc).

    Returns a summary dict: shards (paths), n_tokens, docs, seconds, tokens_per_s,
    resumed_shards."""
    shard_size, name = int(shard_size), check_name(name)
    if not 1 <= shard_size <= MAX_SHARD:
        raise ValueError(f"shard_size must be in [1, {MAX_SHARD}], got {shard_size}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # one preparation per folder at a time: a second one is refused, naming the first (gpt2core.lock)
    with RunLock(out_dir, what="preparation"):
        return _write_shards(docs, out_dir, name, shard_size, settings, overwrite, progress, chunk_chars, log,
                             num_procs)


def _write_shards(docs, out_dir: Path, name: str, shard_size: int, settings, overwrite, progress, chunk_chars, log,
                  num_procs) -> dict:
    settings = dict(settings or {}, name=name, shard_size=shard_size)
    manifest_path = out_dir / f"{name}_manifest.json"
    if overwrite:
        for p in _shards_of(out_dir, name) + [manifest_path]:
            p.unlink(missing_ok=True)
    resume = _resume_point(manifest_path, settings, out_dir)
    if resume is None:
        stale = _shards_of(out_dir, name)
        if stale:
            raise InputError(f"{out_dir} already has shards ({stale[0].name}, ...) but no {manifest_path.name} "
                             "to resume from; use another --out-dir, or --overwrite to replace them")
        resume = {"shards": [], "complete": False, "stats": {}}
    shards = list(resume["shards"])
    n_resumed = len(shards)
    if resume["complete"]:
        n = sum(s["n_tokens"] for s in shards)
        log(f"{out_dir}: already complete ({len(shards)} shards, {n:,} tokens); nothing to do")
        return {"shards": [out_dir / s["file"] for s in shards], "n_tokens": n, "resumed_shards": len(shards),
                "docs": resume["stats"].get("docs"),
                "seconds": 0.0, "tokens_per_s": 0.0}
    start_doc = shards[-1]["next_doc"] if shards else 0
    skip_tokens = shards[-1]["next_doc_offset"] if shards else 0
    n_done = sum(s["n_tokens"] for s in shards)
    if shards:
        log(f"resuming: keeping {len(shards)} finished shards ({n_done:,} tokens), "
            f"continuing at document {start_doc:,}")
    # leftovers of a killed run
    for p in _shards_of(out_dir, name, ".tmp") + [manifest_path.with_name(manifest_path.name + ".tmp")]:
        p.unlink(missing_ok=True)

    manifest = {"version": MANIFEST_VERSION, "settings": settings, "shards": shards, "complete": False}

    def flush(buf, doc, offset):
        index = len(shards)
        path = write_shard(shard_path(out_dir, name, index), buf)
        shards.append({"file": path.name, "n_tokens": int(buf.size), "next_doc": int(doc),
                       "next_doc_offset": int(offset)})
        _write_json_atomic(manifest_path, manifest)

    from tqdm.auto import tqdm
    bar = tqdm(unit="tok", unit_scale=True, disable=not progress, desc=f"{name}", mininterval=0.5)
    buf = np.empty(shard_size, dtype=np.uint16)
    fill, doc_base, n_docs, n_tok = 0, start_doc, 0, 0
    _init_worker()       # load the vocabulary once, before timing (forked workers inherit it)
    t0 = time.perf_counter()
    docs = itertools.islice(iter(docs), start_doc, None)
    try:
        for toks, lens in _tokenized(docs, num_procs, chunk_chars):
            chunk_skip, skip_tokens = skip_tokens, 0
            if chunk_skip:                  # the first document was partly in the last kept shard
                toks, lens = toks[chunk_skip:], lens.copy()
                lens[0] -= chunk_skip
            starts = np.concatenate([[0], np.cumsum(lens)])
            pos = 0
            while pos < toks.size:
                take = min(shard_size - fill, toks.size - pos)
                buf[fill:fill + take] = toks[pos:pos + take]
                fill, pos = fill + take, pos + take
                if fill == shard_size:
                    # the next shard starts in document j (of this chunk) at token `offset`
                    j = int(np.searchsorted(starts, pos, side="right")) - 1
                    offset = pos - int(starts[j])
                    if j == 0 and offset:
                        offset += chunk_skip
                    flush(buf, doc_base + j, offset)
                    fill = 0
            doc_base += len(lens)
            n_docs += len(lens)
            n_tok += int(toks.size)
            bar.update(int(toks.size))
            bar.set_postfix(docs=n_docs, shard=len(shards), refresh=False)
        if fill:
            flush(buf[:fill].copy(), doc_base, 0)
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    if not shards:
        raise InputError(f"the input holds no text ({n_docs:,} documents, 0 tokens): no shards written to {out_dir}")
    manifest["complete"] = True
    manifest["stats"] = {"docs": n_docs}
    _write_json_atomic(manifest_path, manifest)
    total = sum(s["n_tokens"] for s in shards)
    if len(shards) == 1:
        log(f"warning: all {total:,} tokens went into the val shard {shards[0]['file']}; "
            "use a smaller --shard-size to get training shards")
    return {"shards": [out_dir / s["file"] for s in shards], "n_tokens": total, "docs": n_docs,
            "seconds": seconds, "tokens_per_s": n_tok / max(seconds, 1e-9),
            "resumed_shards": n_resumed}


def default_out_dir(dataset: str = "edu", sample: str = "10BT") -> Path:
    """data/edu_fineweb10B for FineWeb-Edu sample-10BT, data/fineweb100B for FineWeb sample-100BT..."""
    return Path("data") / (("edu_fineweb" if dataset == "edu" else "fineweb") + sample.rstrip("T"))


def _input_signature(files) -> list:
    return [[str(Path(p).resolve()), Path(p).stat().st_size] for p in files]


def prepare(inputs=None, out_dir=None, dataset: str = "edu", sample: str = "10BT", name: str | None = None,
            shard_size: int = 10**8, num_procs: int | None = None, text_field: str = "text",
            utf8_errors: str = "strict", overwrite: bool = False, progress: bool = True,
            cache_dir=None, log=print) -> dict:
    """Make shards from local `inputs` (files or directories) or, when None, from the Hugging Face
    Hub. Returns write_shards' summary."""
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {sorted(DATASETS)}, got {dataset!r}")
    if utf8_errors not in ("strict", "replace"):
        raise ValueError(f"utf8_errors must be 'strict' or 'replace', got {utf8_errors!r}")
    name = check_name(name or DEFAULT_NAMES[dataset])    # before any download
    if out_dir is None:
        out_dir = default_out_dir(dataset, sample)
    if num_procs is None:
        num_procs = max(1, (os.cpu_count() or 2) // 2)
    if inputs:
        files = _local_files(inputs)
        settings = {"source": "local", "inputs": _input_signature(files), "text_field": text_field}
        docs = iter_local_documents(files, text_field, utf8_errors)
    else:
        settings = {"source": DATASETS[dataset], "config": f"sample-{sample}", "text_field": text_field}
        docs = iter_hf_documents(dataset, sample, text_field, cache_dir)
    return write_shards(docs, out_dir, name=name, shard_size=shard_size, num_procs=num_procs,
                        settings=settings, overwrite=overwrite, progress=progress, log=log)


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("--input", "-i", nargs="+", metavar="PATH", type=cli.existing_path,
                   help="local jsonl/parquet/txt files or directories (default: download from the Hub)")
    p.add_argument("--dataset", choices=sorted(DATASETS), default="edu",
                   help="edu: HuggingFaceFW/fineweb-edu (default); fineweb: HuggingFaceFW/fineweb")
    p.add_argument("--sample", default="10BT", help="Hub sample config: 10BT (default), 100BT, 350BT")
    p.add_argument("--out-dir", "-o", type=cli.output_dir, help="output directory (default: data/edu_fineweb10B, data/fineweb100B, "
                                           "... after --dataset and --sample)")
    p.add_argument("--name", help="shard name prefix: <name>_val_000000.bin, <name>_train_000001.bin, ... "
                                  "(default: edufineweb, or fineweb for --dataset fineweb)")
    p.add_argument("--shard-size", type=cli.positive_int, default=10**8,
                   help="tokens per shard (default 1e8); shard 0 is validation")
    p.add_argument("--num-procs", "-j", type=cli.positive_int, default=None,
                   help="tokenizer processes (default: half the CPU cores)")
    p.add_argument("--text-field", default="text", help="field/column holding the text (default: text)")
    p.add_argument("--utf8-errors", choices=["strict", "replace"], default="strict",
                   help="invalid UTF-8 in inputs: stop with an error (default) or replace with U+FFFD")
    p.add_argument("--overwrite", action="store_true", help="delete earlier shards of this name first")
    p.add_argument("--cache-dir", help="Hugging Face cache directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(argv=None) -> int:
    p = cli.ArgumentParser(prog="python -m gpt2core.data fineweb",
                                description="FineWeb-Edu -> GPT-2 token shards (llm.c format)")
    add_arguments(p)
    return run(p.parse_args(argv))


console = cli.entry("python -m gpt2core.data fineweb", main)


def run(args) -> int:
    try:
        r = prepare(args.input, args.out_dir, dataset=args.dataset, sample=args.sample, name=args.name,
                    shard_size=args.shard_size, num_procs=args.num_procs, text_field=args.text_field,
                    utf8_errors=args.utf8_errors, overwrite=args.overwrite,
                    progress=not args.no_progress, cache_dir=args.cache_dir)
    except (InputError, RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    shards = r["shards"]
    if shards:
        print(f"{len(shards)} shards, {r['n_tokens']:,} tokens in {shards[0].parent} "
              f"({shards[0].name} .. {shards[-1].name})")
    if r["seconds"]:
        print(f"{r['docs']:,} documents, {r['seconds']:.1f} s, {r['tokens_per_s']:,.0f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(console())
