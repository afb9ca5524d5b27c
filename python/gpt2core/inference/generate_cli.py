"""Generate text: `python -m gpt2core.generate --model out/model.bin "prompt"` (console script
`gpt2core-generate`). Seeded sampling (top-k, top-p, temperature) through the KV cache, streamed to the terminal.

Several prompts: `--prompts-file FILE` (one prompt per line; `-` reads standard input; `\\n` in a line is a
newline), each continued --num-samples times, all in one batch. One sequence streams its text as the tokens
are made; several print each text when it is complete. The speed (prefill ms, decode tokens/s) goes to standard
error (--no-stats: not).
"""
from __future__ import annotations

import argparse
import codecs
import sys
import time

from .. import cli, tokenizer
from ..errors import Error, FileFormatError, utf8_text
from ..model.engine import truncate_at_stop
from ..model import load_model


def read_prompts(path: str) -> list[str]:
    """The prompts of --prompts-file: the bytes of the file (or of standard input for '-'), UTF-8 text, one prompt
    per line. Bytes that are not UTF-8 are refused the same way from either (FileFormatError naming the source)."""
    where = "standard input" if path == "-" else path
    if path == "-":
        if sys.stdin is None:  # started with standard input closed (<&-)
            raise Error("--prompts-file -: standard input is closed: give the prompts on it, or a file")
        raw = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode("utf-8")
    else:
        with open(path, "rb") as f:
            raw = f.read()
    text = utf8_text(raw, f"--prompts-file {path}: {where}")
    if "\0" in text:
        raise FileFormatError(f"--prompts-file {path}: {where} holds a NUL byte: not a text file of prompts")
    prompts = [line.replace("\\n", "\n") for line in text.splitlines() if line.strip()]
    if not prompts:
        raise cli.ArgError(f"--prompts-file {path}: no prompts (one per line)")
    return prompts


def check_vocab(config, model: str) -> None:
    """The command line encodes prompts and decodes replies with GPT-2's tokenizer: a model whose vocabulary is
    smaller than GPT-2's (50,257 tokens) cannot read them (ArgError naming --model)."""
    if config.vocab_size < tokenizer.VOCAB_SIZE:
        raise cli.ArgError(f"--model {model}: its vocabulary has {config.vocab_size:,} tokens, not GPT-2's "
                           f"{tokenizer.VOCAB_SIZE:,}: it does not match GPT-2's tokenizer, which this command "
                           "encodes and decodes text with (generate from Python with your own token ids: "
                           "GPT2.generate)")


def add_sampling_flags(ap, temperature: float = 1.0) -> None:
    """--top-k, --top-p and --temperature (gpt2core-generate's, gpt2core-chat's)."""
    ap.add_argument("--top-k", type=cli.Int(0, 2**31 - 1), default=50,
                    help="sample from the k most likely tokens (default 50; 0: all; 1: greedy)")
    ap.add_argument("--top-p", type=cli.Float(0, 1, lo_open=True), default=None,
                    help="nucleus sampling: the smallest set of tokens whose probability reaches P (default: off)")
    ap.add_argument("--temperature", type=cli.positive_float, default=temperature,
                    help=f"softmax temperature > 0 (default {temperature:g})")


def build_parser() -> argparse.ArgumentParser:
    ap = cli.ArgumentParser(prog="gpt2core-generate", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt", nargs="?", default=None, help="text to continue (default: a newline)")
    ap.add_argument("--model", required=True,
                    help="an llm.c model file (v3 fp32 or v5 bf16, e.g. out/model.bin), a training checkpoint "
                         "directory, a Hugging Face GPT-2 directory, or a Hub name such as gpt2")
    ap.add_argument("--prompts-file", default=None, metavar="FILE",
                    help="one prompt per line ('-': standard input), generated together as one batch")
    ap.add_argument("--max-new-tokens", type=cli.Int(0, 2**31 - 1), default=64, help="tokens to add (default 64)")
    add_sampling_flags(ap)
    ap.add_argument("--stop", action="append", default=None, metavar="TEXT",
                    help="end a sequence once its text contains TEXT (repeatable; the text is cut before it)")
    ap.add_argument("--num-samples", type=cli.positive_int, default=1, help="samples per prompt (default 1)")
    ap.add_argument("--seed", type=cli.seed, default=42, help="sampling seed (default 42)")
    ap.add_argument("--device", type=cli.device, default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    ap.add_argument("--weights", choices=["fp32", "bf16", "fp16", "int8"], default="fp32",
                    help="decode from 16-bit (bf16, fp16: half the bytes per token) or 8-bit copies of the weights "
                         "(int8: blocks of 32 with a scale, 1.125 bytes per weight); CPU; the weights are rounded")
    ap.add_argument("--no-stats", dest="stats", action="store_false",
                    help="do not print the speed line (prefill ms, decode tokens/s) to standard error")
    return ap


def main(argv=None) -> list[str]:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.prompt is not None and args.prompts_file is not None:
        ap.error("give a prompt or --prompts-file, not both")
    if sys.stdout is None:  # started with standard output closed (>&-): the text would go nowhere
        raise Error("standard output is closed: nothing to write the text to (redirect it to a file, or to "
                    "/dev/null with --no-stats for the speed alone)")
    texts_in = read_prompts(args.prompts_file) if args.prompts_file else [args.prompt if args.prompt is not None
                                                                          else "\n"]
    try:
        cli.check_device_available(args.device)
        model = load_model(args.model, device=args.device, inference_weights=args.weights)
        check_vocab(model.config, args.model)
    except BaseException as e:
        cli.reraise_as_exit("gpt2core-generate", e)
        raise
    texts_in = [t for t in texts_in for _ in range(args.num_samples)]
    prompts = [tokenizer.encode(t) or [tokenizer.EOT] for t in texts_in]
    steps = model.generate(prompts, args.max_new_tokens, top_k=args.top_k, temperature=args.temperature,
                           seed=args.seed, top_p=args.top_p, stop=args.stop, stream=True)
    B = len(prompts)
    out = [[] for _ in range(B)]
    enc = tokenizer.get_encoding()
    stream_one = B == 1 and not args.stop  # with stop strings the text is cut before them: printed at the end
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    if stream_one:
        sys.stdout.write(texts_in[0])
        sys.stdout.flush()
    t0 = time.perf_counter()
    t_first, n_tokens = None, 0
    for step in steps:
        if t_first is None:
            t_first = time.perf_counter()
        for b, t in enumerate(step):
            if t < 0:
                continue
            n_tokens += 1
            out[b].append(int(t))
            if stream_one and t != tokenizer.EOT:
                sys.stdout.write(utf8.decode(enc.decode_single_token_bytes(int(t))))
                sys.stdout.flush()
    t1 = time.perf_counter()
    texts = []
    for b in range(B):
        gen = [t for t in out[b] if t != tokenizer.EOT]
        texts.append(texts_in[b] + truncate_at_stop(tokenizer.decode(gen), args.stop))
    if stream_one:
        sys.stdout.write(utf8.decode(b"", final=True) + "\n" + "-" * 40 + "\n")
    else:
        for t in texts:
            print(t)
            print("-" * 40)
    if args.stats and t_first is not None:
        decoded = n_tokens - B  # the first token of each sequence comes with the prefill
        rate = decoded / (t1 - t_first) if t1 > t_first and decoded > 0 else float("nan")
        print(f"prefill {1e3 * (t_first - t0):.0f} ms ({B} prompt{'s' * (B > 1)}); {n_tokens} tokens, decode "
              f"{rate:.1f} tokens/s", file=sys.stderr)
    return texts


# the console script `gpt2core-generate` (main() returns the texts to Python callers)
console = cli.entry("gpt2core-generate", main)

if __name__ == "__main__":
    sys.exit(console())
