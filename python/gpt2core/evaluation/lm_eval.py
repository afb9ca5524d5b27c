"""gpt2core models in EleutherAI's lm-evaluation-harness: the model class `gpt2core` (loglikelihood,
loglikelihood_rolling and generate_until on the core's batched inference path).

    pip install 'gpt2core[eval]'                          # lm-eval (its core needs no torch)
    python -m gpt2core.lm_eval --model-path out/model.bin --tasks hellaswag [--include_path my_tasks/] [lm-eval flags]

    import gpt2core.evaluation.lm_eval, lm_eval  # registers "gpt2core" with lm-eval
    lm_eval.simple_evaluate(model="gpt2core", model_args="path=out/model.bin", tasks=["lambada_openai"])
    lm_eval.simple_evaluate(model=gpt2core.evaluation.lm_eval.GPT2CoreLM(model=my_gpt2), tasks=[...])  # a GPT2 in memory

model_args: path (a model file, training checkpoint or Hugging Face model: gpt2core.load_model), device (cpu, cuda,
cuda:N), batch_tokens (positions per forward, default 4096), max_gen_toks (default 256), inference_weights (fp32,
bf16, fp16, int8). lm-eval's batch_size is accepted and unused: requests are packed by tokens, longest first.

The command line is lm-eval's own (`lm-eval run`), with the model registered first and --model-path PATH standing for
`--model gpt2core --model_args path=PATH` (merged with any --model_args given); --device defaults to cpu (lm-eval's
own default is cuda:0). A wrapper rather than lm-eval's CLI
directly: lm-eval 0.4 finds model classes in its registry only (register_model, or a "module:attr" placeholder
registered from Python); it reads no entry points of other packages, so `lm-eval --model gpt2core` cannot import
gpt2core by itself.

What it computes, as lm-eval's Hugging Face model (`--model hf`) does, so the two agree on an exported model:
  * loglikelihood(context, continuation): lm-eval's TemplateLM splits the text (trailing spaces of the context move
    to the continuation; an empty context is <|endoftext|>); the row context + continuation keeps its last
    block_size + 1 tokens; the result is (sum of the continuation's log-probabilities, whether greedy decoding
    gives the continuation).
  * loglikelihood_rolling(text): lm-eval's disjoint rolling windows of block_size tokens after <|endoftext|>,
    their log-likelihoods summed.
  * generate_until(context, {until, max_gen_toks, do_sample, temperature, top_p}): the context's last
    block_size - max_gen_toks tokens, greedy unless do_sample with a temperature > 0, stopped at <|endoftext|> or
    one of `until`, the text cut before the first stop string.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval import utils as _lm_utils
except ImportError as e:  # the optional dependency
    raise ImportError("gpt2core.lm_eval needs lm-evaluation-harness: pip install 'gpt2core[eval]' (or lm-eval)") from e

from .. import cli, tokenizer
from .scoring import score_spans


@register_model("gpt2core")
class GPT2CoreLM(TemplateLM):
    """A gpt2core model as an lm-eval LM (see the module doc)."""

    def __init__(self, path=None, model=None, device: str = "cpu", batch_tokens: int = 4096, max_gen_toks: int = 256,
                 inference_weights: str = "fp32", batch_size=None, max_batch_size=None, **unused):
        super().__init__()
        if (path is None) == (model is None):
            raise ValueError("gpt2core lm-eval model: give path=<model file, checkpoint or Hugging Face model> "
                             "(model_args) or model=<a GPT2>, one of them")
        if unused:
            raise ValueError(f"gpt2core lm-eval model: unknown model_args {', '.join(sorted(unused))} (known: path, "
                             "device, batch_tokens, max_gen_toks, inference_weights)")
        if model is None:
            from ..model import load_model
            model = load_model(str(path), device=str(device), inference_weights=str(inference_weights))
        self.model = model
        self.batch_tokens = int(batch_tokens)
        self.max_gen_toks = int(max_gen_toks)
        self._device = str(device)

    # ------------------------------------------------------------------ what TemplateLM asks
    @property
    def eot_token_id(self) -> int:
        return tokenizer.EOT

    @property
    def max_length(self) -> int:
        return int(self.model.config.block_size)

    @property
    def device(self):
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return "gpt2"

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return tokenizer.encode(string)

    def tok_decode(self, tokens) -> str:
        return tokenizer.decode(tokens)

    def _score(self, pairs, greedy: bool):
        """(log-likelihoods, greedy flags) of (context ids, continuation ids) pairs: each row keeps its last
        block_size + 1 tokens, the continuation is the span."""
        rows, spans = [], []
        for ctx, cont in pairs:
            row = (list(ctx) + list(cont))[-(self.max_length + 1):]
            rows.append(row)
            spans.append((max(1, len(row) - len(cont)), len(row)))
        nll, _, match = score_spans(self.model, rows, spans, batch_tokens=self.batch_tokens, greedy=greedy)
        return [-float(x) for x in nll], match

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        ll, match = self._score([(ctx, cont) for _, ctx, cont in requests], greedy=True)
        out = []
        for (key, _, _), v, g in zip(requests, ll, match):
            out.append((v, bool(g)))
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, out[-1])
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, req in enumerate(requests):
            (text,) = req.args
            for w in _lm_utils.get_rolling_token_windows(token_list=self.tok_encode(text),
                                                         prefix_token=self.prefix_token_id,
                                                         max_seq_len=self.max_length, context_len=1):
                windows.append(_lm_utils.make_disjoint_window(w))
                owner.append(i)
        ll, _ = self._score(windows, greedy=False)
        out = [0.0] * len(requests)
        for i, v in zip(owner, ll):
            out[i] += v
        for req, v in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, v)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from ..model.engine import truncate_at_stop
        out = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):  # one generate call per set of settings
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        for key, ids in groups.items():
            kw = dict(requests[ids[0]].args[1])
            until = kw.pop("until", None)
            until = [until] if isinstance(until, str) else [s for s in (until or []) if s]
            max_new = int(kw.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(kw.pop("temperature", 0.0) or 0.0)
            do_sample = bool(kw.pop("do_sample", False)) and temperature > 0
            keep = max(1, self.max_length - max_new)
            prompts = [(self.tok_encode(requests[i].args[0]) or [self.eot_token_id])[-keep:] for i in ids]
            for c0 in range(0, len(prompts), 16):
                chunk = prompts[c0:c0 + 16]
                gen = self.model.generate(chunk, max_new, top_k=0 if do_sample else 1,
                                          temperature=temperature if do_sample else 1.0,
                                          top_p=kw.get("top_p") if do_sample else None, seed=0, stop=until or None)
                for i, p, g in zip(ids[c0:c0 + 16], chunk, gen):
                    toks = [t for t in g[len(p):].tolist() if t != self.eot_token_id]
                    out[i] = truncate_at_stop(self.tok_decode(toks), until)
                    self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
        return out


def write_multiple_choice_task(folder, name: str, docs) -> str:
    """A local lm-eval task over your own data: docs (dicts with "text", "choices" (a list of strings) and "label"
    (the index of the right choice)) go to folder/<name>.jsonl and the task to folder/<name>.yaml (multiple choice,
    acc and acc_norm; context = text, continuation = " " + choice). Run it with --include_path folder --tasks name
    (TaskManager(include_path=folder) in Python). Returns the task name."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps({k: d[k] for k in ("text", "choices", "label")}, ensure_ascii=False) + "\n"
                            for d in docs), encoding="utf-8")
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{text}}\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{label}}\"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n", encoding="utf-8")
    return name


HELP = """usage: python -m gpt2core.lm_eval --model-path PATH --tasks TASK [TASK ...] [lm-eval's flags]

lm-evaluation-harness with gpt2core's model class registered (gpt2core.evaluation.lm_eval).

gpt2core's flags:
  --model-path PATH  the model: an llm.c model file (out/model.bin), a training checkpoint directory, a run folder
                     or a Hugging Face model; stands for --model gpt2core --model_args path=PATH (merged with any
                     --model_args: device, batch_tokens, max_gen_toks, inference_weights)
  --device DEVICE    cpu (the default here; lm-eval's own is cuda:0), cuda or cuda:N

lm-eval's own flags (its `lm-eval run --help`) follow.
"""


def main(argv=None) -> int:
    """lm-eval's command line with gpt2core registered; --model-path PATH = --model gpt2core --model_args path=PATH."""
    from lm_eval.__main__ import cli_evaluate
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "run":
        args = args[1:]
    if "-h" in args or "--help" in args:  # gpt2core's own flags first, then lm-eval's help
        print(HELP, flush=True)
    if "--model-path" in args or any(a.startswith("--model-path=") for a in args):
        i = next(j for j, a in enumerate(args) if a == "--model-path" or a.startswith("--model-path="))
        if args[i] == "--model-path":
            if i + 1 >= len(args):
                raise SystemExit("gpt2core.lm_eval: --model-path needs a value (a model file, checkpoint or Hugging "
                                 "Face model)")
            path = args[i + 1]
            del args[i:i + 2]
        else:
            path = args[i].split("=", 1)[1]
            del args[i]
        if "--model" in args and args[args.index("--model") + 1] != "gpt2core":
            raise SystemExit("gpt2core.lm_eval: --model-path is for --model gpt2core; leave --model out")
        args = ["--model", "gpt2core", "--model_args", f"path={path}"] + args
    elif "--model" not in args:
        args = ["--model", "gpt2core"] + args
    if not any(a == "--device" or a.startswith("--device=") for a in args):
        args += ["--device", "cpu"]  # lm-eval's default is cuda:0; gpt2core's is the CPU, as everywhere else
    old = sys.argv
    sys.argv = ["lm-eval", "run", *args]
    try:
        cli_evaluate()
    finally:
        sys.argv = old
    return 0


console = cli.entry("gpt2core.lm_eval", main)

__all__ = ["GPT2CoreLM", "write_multiple_choice_task", "main", "console"]

if __name__ == "__main__":
    sys.exit(console())
