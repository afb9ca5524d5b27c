"""Chat with a fine-tuned model in the terminal: `gpt2core-chat --model out/sft/model.bin` (python -m
gpt2core.chat_cli).

Type a message and press Enter; the reply streams as the model writes it and ends at the model's
<|assistant_end|> (or after --max-new-tokens). The conversation is kept, rendered in the chat format (gpt2core.chat)
at every turn, so the model sees everything said so far. Commands: /clear starts a new conversation (the --system
prompt kept), /quit (or end of input, Ctrl-D) leaves. Reads standard input line by line, so a file of messages can be
piped in. The model must have been fine-tuned on conversations (gpt2core-train --sft ...).
"""
from __future__ import annotations

import argparse
import sys

from .. import _C, chat, cli
from ..errors import ArgError, Error
from .generate_cli import add_sampling_flags
from ..model import load_model


def build_parser() -> argparse.ArgumentParser:
    ap = cli.ArgumentParser(prog="gpt2core-chat", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a model fine-tuned with gpt2core-train --sft: its run folder "
                                                    "(e.g. out/sft), its model.bin or a checkpoint directory")
    ap.add_argument("--system", default=None, metavar="TEXT", help="a system message that opens every conversation")
    ap.add_argument("--max-new-tokens", type=cli.positive_int, default=256,
                    help="longest reply in tokens (default 256; never past the model's context)")
    add_sampling_flags(ap, temperature=0.8)
    ap.add_argument("--seed", type=cli.seed, default=42, help="sampling seed of the first reply; the n-th reply uses "
                                                              "seed + n (default 42)")
    ap.add_argument("--device", type=cli.device, default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    ap.add_argument("--threads", type=cli.positive_int, default=None,
                    help="OpenMP threads of the CPU backend (default: all cores)")
    return ap


def main(argv=None, stdin=None, stdout=None) -> list[dict]:
    """Runs the chat until /quit or the end of input; returns the last conversation's messages."""
    args = build_parser().parse_args(argv)
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    if stdin is None or stdout is None:  # started with one of them closed (<&- or >&-)
        raise Error(f"standard {'input' if stdin is None else 'output'} is closed: gpt2core-chat reads messages "
                    "from standard input and writes the replies to standard output")
    if args.threads is not None:
        _C.set_num_threads(cli.threads(args.threads, "--threads"))
    cli.check_device_available(args.device)
    model = load_model(args.model, device=args.device)
    chat.check_model(model.config)
    opening = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(opening)
    interactive = stdin.isatty()
    turn = 0

    def say(text: str) -> None:
        stdout.write(text)
        stdout.flush()

    say("gpt2core-chat: type a message; /clear starts over, /quit leaves\n")
    while True:
        if interactive:
            say("> ")
        line = stdin.readline()
        if not line:
            break
        text = line.rstrip("\n")
        if text.strip() in ("/quit", "/exit"):
            break
        if text.strip() == "/clear":
            messages = list(opening)
            say("(new conversation)\n")
            continue
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        try:
            pieces = model.chat(messages, max_new_tokens=args.max_new_tokens, top_k=args.top_k,
                                temperature=args.temperature, top_p=args.top_p, seed=args.seed + turn, stream=True)
        except ArgError as e:  # the conversation fills the context
            messages.pop()
            say(f"({e}; /clear starts a new conversation)\n")
            continue
        reply = []
        say("assistant: ")
        for piece in pieces:
            reply.append(piece)
            say(piece)
        say("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
        turn += 1
    return messages


# the console script `gpt2core-chat` (behind gpt2core.cli's error boundary: exit 1 / 2 with one line)
console = cli.entry("gpt2core-chat", main)

if __name__ == "__main__":
    sys.exit(console())
