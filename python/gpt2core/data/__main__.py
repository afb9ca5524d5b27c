"""Dataset preparation: `python -m gpt2core.data {fineweb,hellaswag,shakespeare} [options]`.

    python -m gpt2core.data fineweb --input ../shared/data/fineweb/fineweb_10BT_sample300.jsonl \\
        --out-dir /tmp/fw300 --shard-size 100000          # local files; without --input: the Hub
    python -m gpt2core.data hellaswag --input hellaswag_val_full.txt --out data/hellaswag/hellaswag_val.npz
    python -m gpt2core.data shakespeare [args]             # Tiny Shakespeare shards

`python -m gpt2core.data SUBCOMMAND --help` lists each one's options.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from .. import cli


def _shakespeare(argv) -> int:
    mod = importlib.import_module(".shakespeare", __package__)
    if hasattr(mod, "main"):
        rc = mod.main(argv)
        return int(rc or 0)
    raise AssertionError("gpt2core.data.shakespeare has a main()")


def main(argv=None) -> int:
    from . import fineweb, hellaswag

    argv = list(sys.argv[1:] if argv is None else argv)
    p = cli.ArgumentParser(prog="python -m gpt2core.data", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[1:]))
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{fineweb,hellaswag,shakespeare}")
    fineweb.add_arguments(sub.add_parser("fineweb", help="FineWeb-Edu -> token shards"))
    hellaswag.add_arguments(sub.add_parser("hellaswag", help="render the HellaSwag val set"))
    sub.add_parser("shakespeare", help="Tiny Shakespeare -> token shards", add_help=False)
    if argv and argv[0] == "shakespeare":      # its options belong to gpt2core.data.shakespeare
        return _shakespeare(argv[1:])
    args = p.parse_args(argv)
    if args.cmd == "fineweb":
        return fineweb.run(args)
    return hellaswag.run(args)


console = cli.entry("python -m gpt2core.data", main)

if __name__ == "__main__":
    sys.exit(console())
