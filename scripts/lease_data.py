"""Token shards for a GPU lease's `learn` step: at most --max-mib MiB (default 60) of GPT-2 tokens from English text
reachable here, in llm.c's shard format (shard 0 = validation), with a manifest the lease checks before it trains.

Where the text comes from (origin, versions, licences and the figures below: docs/DATA_SOURCES.md):
  - by default three Debian 12 documentation packages, fetched with `apt-get download` and unpacked with
    `dpkg-deb -x` (no installation, no root): linux-doc-6.12 (the Linux kernel's reStructuredText documentation,
    GPL-2), python3.11-doc (Sphinx's reStructuredText sources of the Python documentation, PSF License) and
    perl-doc (Perl's core pod pages, GPL-1+ or Artistic);
  - or local text files / folders given as arguments (offline; --licence and --source say what they are).
Each file is one document, preceded by <|endoftext|> (50256) as llm.c's FineWeb shards are; the files of all
sources are put in one fixed shuffled order (random.Random(0)), so validation samples every source. One record:
linux-doc's Documentation/admin-guide/README.rst starts "Linux kernel release 6.x <http://kernel.org/>".

    python scripts/lease_data.py --out lease_data                   # the lease's folder (about 34 MiB)
    python scripts/lease_data.py --out small --max-mib 4 notes/ a.txt --licence CC0-1.0 --source "my notes"

writes DIR/<name>_val_000000.bin (--val-tokens, default 1,000,000), DIR/<name>_train_000001.bin, ... (--shard-tokens
each, the last one shorter) and DIR/manifest.json = {"files": [{"path", "sha256", "tokens"}], "source", "licence"}
(paths relative to DIR, so the folder can be carried anywhere). The shard files together, headers included, never
exceed --max-mib MiB: the text is cut where the budget ends. With the three packages (versions as of 2026-11-29):
5,616 files, 17,950,644 tokens (1,000,000 validation) in 3 shards, 34.2 MiB, about 45 s on 2 cores (the sha256 of
each shard: docs/DATA_SOURCES.md).
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

# Debian package -> (what is read of its unpacked tree, the licence its copyright file gives for that text)
PACKAGES = {
    "linux-doc-6.12": ("usr/share/doc/linux-doc-6.12/Documentation/**/*.rst.gz and *.txt.gz, not html/",
                       "GPL-2 (debian/copyright: Files: *, License: GPL-2; some documents dual-licensed, "
                       "see their SPDX lines)"),
    "python3.11-doc": ("usr/share/doc/python3.11/html/_sources/**/*.txt (Sphinx's reStructuredText sources)",
                       "PSF-2.0 (debian/copyright: the Python Software Foundation License)"),
    "perl-doc": ("usr/share/perl/*/pod/*.pod (Perl's core documentation)",
                 "GPL-1+ or Artistic (debian/copyright: Files: *)"),
}
TEXT_SUFFIXES = (".txt", ".rst", ".md", ".pod", ".text")
HEADER_BYTES = 1024
MIB = 1 << 20


def fail(msg: str) -> None:
    raise SystemExit(f"lease_data: {msg}")


def package_files(package: str, root: Path) -> list[Path]:
    """The text files of an unpacked package (PACKAGES says which)."""
    files = [p for p in root.rglob("*") if p.is_file()]
    if package.startswith("linux-doc-"):
        return [p for p in files if p.name.endswith((".rst.gz", ".txt.gz")) and "/Documentation/" in str(p)
                and "/html/" not in str(p)]
    if package.startswith("python3") and package.endswith("-doc"):
        return [p for p in files if "/html/_sources/" in str(p) and p.name.endswith(".txt")]
    if package == "perl-doc":
        return [p for p in files if p.parent.name == "pod" and p.suffix == ".pod"]
    fail(f"--packages: no reader for {package!r} (known: {', '.join(PACKAGES)})")


def fetch_package(package: str, debs: Path) -> tuple[Path, str]:
    """The package's .deb in `debs` (downloaded with apt-get download when absent), unpacked beside it: (unpacked
    folder, one line naming the archive, its version and sha256)."""
    debs.mkdir(parents=True, exist_ok=True)
    found = sorted(debs.glob(f"{package}_*.deb"))
    if not found:
        r = subprocess.run(["apt-get", "download", package], cwd=debs, capture_output=True, text=True)
        found = sorted(debs.glob(f"{package}_*.deb"))
        if r.returncode != 0 or not found:
            fail(f"apt-get download {package} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    deb = found[-1]
    version = subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True,
                             check=True).stdout.strip()
    tree = debs / f"{package}.unpacked"
    if not tree.exists():
        tmp = debs / f"{package}.unpacking"
        subprocess.run(["rm", "-rf", str(tmp)], check=True)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], check=True)
        tmp.rename(tree)
    return tree, f"Debian {package} {version} ({deb.name}, sha256 {sha256(deb)})"


def local_files(inputs: list[str]) -> list[Path]:
    """Text files named on the command line, and those under named folders (by suffix, gzipped or not)."""
    out = []
    for s in inputs:
        p = Path(s)
        if p.is_dir():
            out += [q for q in p.rglob("*") if q.is_file() and q.name.removesuffix(".gz").endswith(TEXT_SUFFIXES)]
        elif p.is_file():
            out.append(p)
        else:
            fail(f"input {s}: no such file or folder")
    if not out:
        fail(f"no text files ({', '.join(TEXT_SUFFIXES)}, optionally .gz) in {' '.join(inputs)}")
    return out


def read_text(p: Path) -> str:
    raw = p.read_bytes()
    if p.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            fail(f"{p}: not a readable gzip file ({e})")
    return raw.decode("utf-8", errors="replace").strip()


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_shards(files: list[Path], out: Path, name: str, max_bytes: int, val_tokens: int, shard_tokens: int,
                 batch: int = 64) -> list[dict]:
    """Tokenizes `files` in order (one document each, <|endoftext|> first) into shards of llm.c's format, shard 0
    of val_tokens, the others of shard_tokens, stopping where the shard files (headers included) would pass
    max_bytes. Returns the manifest's file entries."""
    from gpt2core.data.shards import shard_filename, write_shard
    from gpt2core.tokenizer import EOT, encode_batch

    entries, buf, used = [], [], 0

    def capacity() -> int:  # tokens the current shard may still take: its size, and the bytes left
        size = val_tokens if not entries else shard_tokens
        return min(size, (max_bytes - used - HEADER_BYTES) // 2) - sum(len(b) for b in buf)

    def flush():
        nonlocal buf, used
        toks = np.concatenate(buf).astype(np.uint16) if buf else np.zeros(0, np.uint16)
        if toks.size == 0:
            return
        path = write_shard(out / shard_filename(name, len(entries)), toks)
        used += path.stat().st_size
        entries.append({"path": path.name, "sha256": sha256(path), "tokens": int(toks.size)})
        buf = []

    for i in range(0, len(files), batch):
        texts = [t for t in (read_text(p) for p in files[i:i + batch]) if t]
        for doc in encode_batch(texts, num_threads=2):
            toks = np.array([EOT, *doc], dtype=np.uint16)
            while toks.size:
                room = capacity()
                if room <= 0:
                    flush()
                    if capacity() <= 0:  # the byte budget is spent
                        return entries
                    continue
                buf.append(toks[:room])
                toks = toks[room:]
    flush()
    return entries


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="lease_data.py", description=__doc__.split("\n")[0])
    ap.add_argument("inputs", nargs="*", help="local text files or folders (instead of the Debian packages)")
    ap.add_argument("--out", required=True, help="the folder for the shards and manifest.json")
    ap.add_argument("--max-mib", type=float, default=60.0, help="the shards' total size in MiB at most (default 60)")
    ap.add_argument("--packages", nargs="+", default=list(PACKAGES), metavar="PKG",
                    help=f"Debian documentation packages to read (default: {' '.join(PACKAGES)})")
    ap.add_argument("--debs", help="where the .deb files are kept and unpacked (default: a temporary folder; "
                                   "a .deb already there is used, not downloaded again)")
    ap.add_argument("--licence", help="the licence of local inputs (required with them)")
    ap.add_argument("--source", help="what local inputs are (default: their paths)")
    ap.add_argument("--name", default="lease", help="the shards' data set name (default lease)")
    ap.add_argument("--val-tokens", type=int, default=1_000_000, help="tokens of shard 0, validation (default 1M)")
    ap.add_argument("--shard-tokens", type=int, default=16_000_000, help="tokens per training shard (default 16M)")
    args = ap.parse_args(argv)
    if not args.max_mib > 0:
        fail(f"--max-mib must be positive, got {args.max_mib}")
    if args.val_tokens < 1 or args.shard_tokens < 1:
        fail("--val-tokens and --shard-tokens must be at least 1")
    max_bytes = int(args.max_mib * MIB)
    if max_bytes < 2 * (HEADER_BYTES + 2):
        fail(f"--max-mib {args.max_mib}: too small for a validation and a training shard")
    from gpt2core.data.shards import check_name
    try:
        check_name(args.name)
    except ValueError as e:
        fail(f"--name: {e}")
    out = Path(args.out)
    if out.exists() and any(out.glob("*.bin")):
        fail(f"--out {out} already holds shards: use an empty or new folder")

    if args.inputs:
        if not args.licence:
            fail("--licence is required with local inputs (the manifest records it)")
        files = sorted(local_files(args.inputs))
        source, licence = args.source or "local files: " + ", ".join(args.inputs), args.licence
    else:
        with tempfile.TemporaryDirectory() as tmp:
            debs = Path(args.debs) if args.debs else Path(tmp)
            files, sources, licences = [], [], []
            for pkg in args.packages:
                if pkg not in PACKAGES:
                    fail(f"--packages: no reader for {pkg!r} (known: {', '.join(PACKAGES)})")
                tree, line = fetch_package(pkg, debs)
                found = sorted(package_files(pkg, tree))
                if not found:
                    fail(f"{pkg}: no text files found ({PACKAGES[pkg][0]})")
                files += found
                sources.append(f"{line}: {len(found)} files, {PACKAGES[pkg][0]}")
                licences.append(f"{pkg}: {PACKAGES[pkg][1]}")
            source, licence = "; ".join(sources), "; ".join(licences)
            return finish(files, out, args, max_bytes, source, licence)
    return finish(files, out, args, max_bytes, source, licence)


def finish(files, out: Path, args, max_bytes: int, source: str, licence: str) -> int:
    random.Random(0).shuffle(files)
    out.mkdir(parents=True, exist_ok=True)
    entries = write_shards(files, out, args.name, max_bytes, args.val_tokens, args.shard_tokens)
    if len(entries) < 2:
        fail(f"only {sum(e['tokens'] for e in entries):,} tokens: not enough text for a validation shard of "
             f"{args.val_tokens:,} tokens and a training shard (lower --val-tokens)")
    manifest = {"files": entries, "source": source, "licence": licence}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum((out / e["path"]).stat().st_size for e in entries)
    print(f"{out}: {sum(e['tokens'] for e in entries):,} tokens in {len(entries)} shards "
          f"({entries[0]['tokens']:,} validation), {total / MIB:.1f} MiB of at most {args.max_mib:g}")
    for e in entries:
        print(f"  {e['path']}  {e['tokens']:>11,} tokens  sha256 {e['sha256']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
