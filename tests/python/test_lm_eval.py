"""lm-evaluation-harness model class (gpt2core.lm_eval): a task defined in a local YAML file over local data run by
lm-eval's own evaluator on a float64 model, its log-likelihoods against an independent numpy computation;
loglikelihood_rolling and generate_until against numpy; a modern-architecture model; the command line; and, where
torch and transformers are installed, the same task through lm-eval's `hf` model on the exported model."""
import json
import math

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")

import numpy_gpt2 as ref  # noqa: E402
from gpt2core import tokenizer  # noqa: E402
from gpt2core.lm_eval import GPT2CoreLM  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from test_core_eval import SV, V, VP, tiny_model  # noqa: E402

MODERN = dict(position="rope", norm="rmsnorm", qk_norm=True, activation="relu2", bias=False, tie_embeddings=False,
              logit_softcap=15.0)
DOCS = [{"question": "The capital of France is", "choices": ["Paris", "London", "a café in Zürich"], "label": 0},
        {"question": "2 + 2 =", "choices": ["4", "5", "22"], "label": 0},
        {"question": "Snow is usually", "choices": ["white", "green"], "label": 0},
        {"question": "東京 is in", "choices": ["Japan", "Peru", "the sea  "], "label": 0}]


class Folded(GPT2CoreLM):
    """GPT-2's ids folded into a model of SV tokens (as test_core_eval's fold; <|endoftext|> -> 0): the same
    harness code paths, ~500x cheaper per position than GPT-2's 50257 columns."""

    @property
    def eot_token_id(self):
        return 0

    def tok_encode(self, string, add_special_tokens=None, **kw):
        return [t % SV for t in tokenizer.encode(string)]


def enc_fold(text, v):
    return [t % v for t in tokenizer.encode(text)]


def numpy_loglikelihood(p, context, continuation, block, arch=None, v=SV):
    """(sum of log p(continuation | context), greedy?) as lm-eval's Hugging Face model splits and scores text:
    trailing spaces of the context move to the continuation, the continuation's tokens are those of the whole text
    after the context's, the row keeps its last block + 1 tokens; numpy float64 forward of that row alone."""
    eot = 0 if v == SV else tokenizer.EOT
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    ctx = enc_fold(context, v) if context else [eot]
    whole = enc_fold(context + continuation, v)
    cont = whole[len(ctx):] if context else enc_fold(continuation, v)
    row = (ctx + cont)[-(block + 1):]
    _, logits, losses = ref.forward(p, np.array([row[:-1]]), np.array([row[1:]]), v, 2, arch=arch)
    k = len(cont)
    greedy = bool((logits[0, -k:, :v].argmax(-1) == np.array(row[-k:])).all())
    return -float(losses[0, -k:].sum()), greedy


def requests(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


@pytest.mark.parametrize("arch", [None, MODERN], ids=["gpt2", "modern"])
def test_loglikelihood_rolling_and_generation_equal_numpy(arch):
    block = 24
    model, p = tiny_model(block=block, arch=arch, seed=4)
    lm = Folded(model=model, batch_tokens=64)
    pairs = [("The capital of France is", " Paris"), ("A long context " * 6, " that is cut from the left"),
             ("ends with spaces   ", "x"), ("", "no context at all"), ("naïve", " café ☕")]
    got = lm.loglikelihood(requests("loglikelihood", pairs))
    for (c, x), (ll, g) in zip(pairs, got):
        want, wg = numpy_loglikelihood(p, c, x, block, arch)
        assert ll == pytest.approx(want, rel=1e-10) and g == wg

    text = "Rolling windows over a text longer than the context: " * 4 + "ünïcödé"
    (rolled,) = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))
    assert rolled == pytest.approx(_rolling_numpy(p, enc_fold(text, SV), block, arch), rel=1e-10)
    assert len(tokenizer.encode(text)) > 2 * block  # several windows

    gen = lm.generate_until(requests("generate_until", [("Once upon a time", {"until": ["\n"], "max_gen_toks": 6}),
                                                        ("The", {"until": "zzz", "max_gen_toks": 4})]))
    for (prompt, n, until), text_out in zip((("Once upon a time", 6, ["\n"]), ("The", 4, ["zzz"])), gen):
        ids = enc_fold(prompt, SV)[-(block - n):]
        out = []
        for _ in range(n):  # greedy, numpy
            x = np.array([(ids + out)[-block:]])
            _, logits, _ = ref.forward(p, x, None, SV, 2, arch=arch)
            out.append(int(logits[0, -1, :SV].argmax()))
        want = tokenizer.decode(out)
        for s in until:
            want = want.split(s)[0]
        assert text_out == want


def _rolling_numpy(p, ids, block, arch):
    """The rolling log-likelihood: lm-eval's windows (lm_eval.utils.get_rolling_token_windows, made disjoint: every
    token predicted once, the first from <|endoftext|>), each window's tokens scored by a numpy forward alone."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
    total = 0.0
    for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(ids, 0, block, 1)):
        r = (ctx + cont)[-(block + 1):]
        _, _, losses = ref.forward(p, np.array([r[:-1]]), np.array([r[1:]]), SV, 2, arch=arch)
        total -= losses[0, -len(cont):].sum()
    return total


@pytest.fixture()
def local_task(tmp_path):
    """DOCS as a task in a local YAML file over a local jsonl (gpt2core.lm_eval.write_multiple_choice_task)."""
    from gpt2core.lm_eval import write_multiple_choice_task
    tasks = tmp_path / "tasks"
    write_multiple_choice_task(tasks, "gpt2core_local_mc",
                               [{"text": d["question"], "choices": d["choices"], "label": d["label"]} for d in DOCS])
    return tasks


def test_local_yaml_task_through_the_harness_equals_numpy(local_task, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval.tasks import TaskManager
    import gpt2core.lm_eval  # noqa: F401 - registers "gpt2core"
    from lm_eval.api.registry import get_model
    assert get_model("gpt2core") is GPT2CoreLM
    model, p = tiny_model(block=32, seed=2)
    out = lm_eval.simple_evaluate(model=Folded(model=model), tasks=["gpt2core_local_mc"],
                                  task_manager=TaskManager(include_path=str(local_task), include_defaults=False),
                                  log_samples=True)
    samples = out["samples"]["gpt2core_local_mc"]
    assert len(samples) == len(DOCS)
    hits = 0
    for s in samples:
        doc = s["doc"]
        lls = [r[0][0] for r in s["resps"]]
        want = [numpy_loglikelihood(p, doc["text"], " " + c, 32)[0] for c in doc["choices"]]
        np.testing.assert_allclose(lls, want, rtol=1e-10)
        hits += int(np.argmax(want) == doc["label"])
    assert out["results"]["gpt2core_local_mc"]["acc,none"] == pytest.approx(hits / len(DOCS))


def test_command_line_runs_lm_evals_cli_with_the_model(local_task, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval.tasks import manager
    init = manager.TaskManager.__init__  # index only --include_path: lm-eval's own ~10k task files take a minute
    monkeypatch.setattr(manager.TaskManager, "__init__", lambda self, *a, **k: init(self, *a, **{
        **k, "include_defaults": False}))
    from gpt2core import lm_eval as glm
    model, _ = tiny_model(block=32, seed=2, vocab=(V, VP))  # GPT-2's ids: a model over its vocabulary
    path = tmp_path / "m.bin"
    model.save(path)
    assert glm.console(["--model-path", str(path), "--tasks", "gpt2core_local_mc", "--include_path", str(local_task),
                        "--output_path", str(tmp_path / "res")]) == 0
    res = list((tmp_path / "res").rglob("results_*.json"))
    assert len(res) == 1
    r = json.loads(res[0].read_text())
    assert r["config"]["model"] == "gpt2core" and "acc,none" in r["results"]["gpt2core_local_mc"]
    with pytest.raises(ValueError, match="unknown model_args bogus"):
        GPT2CoreLM(path=str(path), bogus=1)


def test_exported_model_through_lm_evals_hf_model_agrees(local_task, tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval.tasks import TaskManager
    import shutil
    model, _ = tiny_model(block=32, seed=2, vocab=(V, VP))
    model.save_pretrained(tmp_path / "hf")
    shutil.copyfile(tokenizer.ASSETS / "encoder.json", tmp_path / "hf" / "vocab.json")  # GPT-2's tokenizer files,
    shutil.copyfile(tokenizer.ASSETS / "vocab.bpe", tmp_path / "hf" / "merges.txt")      # which transformers reads
    torch.set_num_threads(1)
    tm = TaskManager(include_path=str(local_task), include_defaults=False)
    # both read the exported fp32 weights: gpt2core's load_model of the HF folder, transformers' GPT2LMHeadModel
    ours = lm_eval.simple_evaluate(model="gpt2core", model_args=f"path={tmp_path / 'hf'}",
                                   tasks=["gpt2core_local_mc"], task_manager=tm, log_samples=True)
    theirs = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={tmp_path / 'hf'},dtype=float32",
                                     tasks=["gpt2core_local_mc"], task_manager=tm, log_samples=True, device="cpu")
    a = [r[0][0] for s in ours["samples"]["gpt2core_local_mc"] for r in s["resps"]]
    b = [r[0][0] for s in theirs["samples"]["gpt2core_local_mc"] for r in s["resps"]]
    assert len(a) == sum(len(d["choices"]) for d in DOCS)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)  # fp32 both, other op orders
