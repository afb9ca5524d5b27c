"""CORE (gpt2core.core_eval): a hand-made bundle in DCLM's format (folder and zip), per-item choices and
log-likelihoods of a float64 model against an independent float64 numpy scoring of the same prompts, HellaSwag in
CORE's format against gpt2core.evaluate's HellaSwag scoring, the few-shot rule against nanochat's procedure written
out, the centering arithmetic, ranks, the command line and bad bundles."""
import csv
import json
import random
import zipfile
from pathlib import Path

import numpy as np
import pytest

import numpy_gpt2 as ref
from gpt2core import GPT2, core_eval, load_model
from gpt2core.config import GPT2Config
from gpt2core.core_eval import BundleError, Task
from gpt2core.data import hellaswag as hs
from gpt2core.evaluate import hellaswag_losses
from gpt2core.tokenizer import get_encoding

HERE = Path(__file__).resolve().parents[1]
SUBSET = HERE / "data" / "hellaswag_val_120.jsonl"
V, VP = 50257, 50304   # GPT-2's vocabulary: what the tokenizer's ids need
SV, SVP = 97, 128      # a small one for the scoring checks: GPT-2's ids folded into it (fold), ~500x cheaper per
                       # position than 50257 columns, and the same rules (both sides see the same folded ids)


def fold(texts):
    """GPT-2 BPE ids mod SV: the encode CORE's functions take, for a model of SV tokens (BOS: 0)."""
    return [[t % SV for t in ids] for ids in get_encoding().encode_ordinary_batch(texts)]


def tiny_model(block=96, seed=0, arch=None, C=16, NH=2, L=1, vocab=(SV, SVP)):
    """An inference-only float64 GPT2 with numpy_gpt2's random weights; returns (model, the weights)."""
    v, vp = vocab
    cfg = GPT2Config(block_size=block, vocab_size=v, padded_vocab_size=vp, n_layer=L, n_head=NH, n_embd=C,
                     **(arch or {}))
    m = GPT2(cfg, dtype="float64", init=False, training=False)
    p = ref.random_params(np.random.default_rng(seed), maxT=block, V=v, Vp=vp, L=L, NH=NH, C=C, arch=arch)
    for k, val in p.items():
        m.params[k][...] = val
    m.params_changed()
    return m, p


def numpy_row(p, row, v=SV, arch=None, NH=2):
    """(per-position losses of row[1:], arg max ids) of one token row, float64 numpy, no batching or padding."""
    x = np.asarray(row[:-1])[None]
    y = np.asarray(row[1:])[None]
    _, logits, losses = ref.forward(p, x, y, v, NH, arch=arch)
    return losses[0], logits[0, :, :v].argmax(-1)


# ------------------------------------------------------------------------------------------------ a bundle
ITEMS = {
    "mc": [{"query": f"Question {i}: which is {w}? Answer:",
            "choices": [f"the {w}", f"the {w}s", "a café ☕", "none"], "gold": i % 4} for i, w in enumerate(["cat", "dog", "tree", "sun", "river", "naïve idea", "東京"])],
    "schema": [{"context_options": [f"The {a} fell because it", f"The {b} fell because it"],
                "continuation": f"was {c}.", "gold": i % 2}
               for i, (a, b, c) in enumerate([("vase", "table", "fragile"), ("ball", "glass", "round"),
                                              ("man", "ladder", "tired"), ("leaf", "rock", "light"),
                                              ("cup", "shelf", "full")])],
    "lm": [{"context": f"  {i} plus {i} equals ", "continuation": f"{2 * i}"} for i in range(6)],
}
YAML = """icl_tasks:
-
  label: mc_3shot
  dataset_uri: world/mc.jsonl
  num_fewshot: [3]
  icl_task_type: multiple_choice
  continuation_delimiter: "\\nAnswer: "
-
  label: mc_zeroshot
  dataset_uri: world/mc.jsonl
  num_fewshot: [0]
  icl_task_type: multiple_choice
-
  label: schema
  dataset_uri: lang/schema.jsonl
  num_fewshot: [2]
  icl_task_type: schema
-
  label: lm
  dataset_uri: sym/lm.jsonl
  num_fewshot: [2]
  icl_task_type: language_modeling
  continuation_delimiter: " "
"""
META = ("Eval Task,Task Category,Task Type,#shots,#datapoints,Random baseline,Centered Metric?,Description\n"
        "mc_3shot,x,multiple choice,3,7,25,,\"four, choices\"\nmc_zeroshot,x,multiple choice,0,7,25,,d\n"
        "schema,x,schema,2,5,50,,d\nlm,x,language modeling,2,6,0,,d\nunused,x,x,0,1,10,,d\n")


def write_bundle(root: Path) -> Path:
    b = root / "eval_bundle"
    for rel, items in (("world/mc.jsonl", ITEMS["mc"]), ("lang/schema.jsonl", ITEMS["schema"]),
                       ("sym/lm.jsonl", ITEMS["lm"])):
        f = b / "eval_data" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("".join(json.dumps(it, ensure_ascii=False) + "\n" for it in items), encoding="utf-8")
    (b / "core.yaml").write_text(YAML)
    (b / "eval_meta_data.csv").write_text(META)
    return b


def zip_bundle(b: Path) -> Path:
    z = b.parent / "eval_bundle.zip"
    with zipfile.ZipFile(z, "w") as f:
        for p in sorted(b.rglob("*")):
            if p.is_file():
                f.write(p, p.relative_to(b.parent).as_posix())
    return z


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return write_bundle(tmp_path_factory.mktemp("core"))


def test_bundle_reads_the_same_from_folder_parent_and_zip(bundle):
    a = core_eval.load_bundle(bundle)
    assert [t.label for t in a] == ["mc_3shot", "mc_zeroshot", "schema", "lm"]
    assert [(t.task_type, t.num_fewshot, t.delimiter, t.random_baseline) for t in a] == [
        ("multiple_choice", 3, "\nAnswer: ", 0.25), ("multiple_choice", 0, " ", 0.25), ("schema", 2, " ", 0.5),
        ("language_modeling", 2, " ", 0.0)]
    assert a[0].items == ITEMS["mc"] and a[3].items == ITEMS["lm"]
    for other in (bundle.parent, zip_bundle(bundle)):
        b = core_eval.load_bundle(other, tasks=["schema", "lm"])
        assert [(t.label, t.items) for t in b] == [(t.label, t.items) for t in a[2:]]


def test_fewshot_rule_is_nanochats_procedure_and_never_the_item():
    for n, k in ((7, 3), (40, 10), (5, 4)):
        data = list(range(n))  # nanochat: shuffle the items with Random(1337), position p samples positions != p
        random.Random(1337).shuffle(data)
        for p, i in enumerate(data):
            want = [data[j] for j in random.Random(1234 + p).sample([j for j in range(n) if j != p], k)]
            got = core_eval.fewshot_indices(n, i, k)
            assert got == want and i not in got and len(set(got)) == k
            assert core_eval.fewshot_indices(n, i, k) == got  # reproducible
    assert core_eval.fewshot_indices(9, 4, 0) == []


def test_prompts_follow_the_rules(bundle):
    mc, mc0, schema, lm = core_eval.load_bundle(bundle)
    ex = [mc.items[j] for j in core_eval.fewshot_indices(7, 2, 3)]
    shots = "".join(f"{e['query']}\nAnswer: {e['choices'][e['gold']]}\n\n" for e in ex)
    assert core_eval.render_item(mc, 2) == [f"{shots}Question 2: which is tree? Answer:\nAnswer: {c}"
                                            for c in ITEMS["mc"][2]["choices"]]
    assert core_eval.render_item(mc0, 5) == [f"Question 5: which is naïve idea? Answer: {c}"
                                             for c in ITEMS["mc"][5]["choices"]]
    ex = [schema.items[j] for j in core_eval.fewshot_indices(5, 1, 2)]
    shots = "".join(f"{e['context_options'][e['gold']]} {e['continuation']}\n\n" for e in ex)
    assert core_eval.render_item(schema, 1) == [f"{shots}The ball fell because it was round.",
                                                f"{shots}The glass fell because it was round."]
    ex = [lm.items[j] for j in core_eval.fewshot_indices(6, 3, 2)]
    shots = "".join(f"{e['context'].strip()} {e['continuation']}\n\n" for e in ex)
    # the context stripped, the prompt without the continuation stripped too (its trailing delimiter goes)
    assert core_eval.render_item(lm, 3) == [f"{shots}3 plus 3 equals", f"{shots}3 plus 3 equals 6"]
    # spans: multiple choice after the common prefix of the choices' rows, schema the common suffix
    rows, sp = core_eval.spans("multiple_choice", [[5, 1, 2, 3], [5, 1, 2, 9, 9], [5, 1, 7]])
    assert sp == [(2, 4), (2, 5), (2, 3)]
    rows, sp = core_eval.spans("schema", [[5, 1, 2, 3], [6, 6, 2, 3]])
    assert sp == [(2, 4), (2, 4)]
    rows, sp = core_eval.spans("language_modeling", [[5, 1], [5, 1, 8, 9]])
    assert rows == [[5, 1, 8, 9]] and sp == [(2, 4)]
    assert core_eval.crop(list(range(10)), (6, 10), 4) == ([6, 7, 8, 9], (1, 4))


def test_centered_arithmetic():
    assert core_eval.centered(0.25, 0.25) == 0.0 and core_eval.centered(1.0, 0.5) == 1.0
    assert core_eval.centered(0.7, 0.4) == pytest.approx(0.5)
    assert core_eval.centered(0.1, 0.0) == pytest.approx(0.1)
    assert core_eval.centered(0.2, 0.5) == pytest.approx(-0.6)  # below chance: negative


def reference_item(task, i, p, block):
    """An independent scoring of item i: the same prompts, tokenized here, spans by os.path-free list logic,
    every row through numpy alone."""
    rows = [[0] + r for r in fold(core_eval.render_item(task, i))]
    if task.task_type == "language_modeling":
        without, with_ = rows
        assert with_[:len(without)] == without
        s, row = len(without), with_[-block:]
        s -= len(with_) - len(row)
        _, am = numpy_row(p, row)
        return {"correct": bool((am[s - 1:] == np.array(row[s:])).all())}
    if task.task_type == "multiple_choice":
        k = 0
        while all(len(r) > k for r in rows) and len({r[k] for r in rows}) == 1:
            k += 1
        bounds = [(k, len(r)) for r in rows]
    else:
        k = 0
        while all(len(r) > k for r in rows) and len({r[-1 - k] for r in rows}) == 1:
            k += 1
        bounds = [(len(r) - k, len(r)) for r in rows]
    means = []
    for r, (s, e) in zip(rows, bounds):
        cut = max(0, len(r) - block)
        losses, _ = numpy_row(p, r[cut:])
        means.append(losses[s - cut - 1:e - cut - 1].mean())
    return {"pred": int(np.argmin(means)), "scores": means}


@pytest.mark.parametrize("block", [96, 40])  # 40: the few-shot prompts are cropped from the left
def test_items_equal_an_independent_numpy_scoring(bundle, block):
    model, p = tiny_model(block=block)
    for task in core_eval.load_bundle(bundle):
        got = core_eval.score_items(model, task, range(len(task.items)), batch_tokens=150, bos=0, encode=fold)
        for i, r in enumerate(got):
            want = reference_item(task, i, p, block)
            assert r["idx"] == i
            if task.task_type == "language_modeling":
                assert r["correct"] == want["correct"]
            else:
                assert r["pred"] == want["pred"] and r["gold"] == task.items[i]["gold"]
                assert r["correct"] == (r["pred"] == r["gold"])
                np.testing.assert_allclose(r["scores"], want["scores"], rtol=1e-10)  # float64 both sides


def test_lm_task_counts_greedy_reproductions():
    """A model made to predict '2' after ' equals' scores an LM item right exactly when its continuation is that."""
    model, _ = tiny_model(block=64, vocab=(V, VP))  # GPT-2's own ids, a few positions
    enc = get_encoding()
    two = enc.encode_ordinary(" 2")[0]
    model.params["wte"][...] = 0.0          # every position's final activation is the LayerNorm bias...
    model.params["lnfw"][...] = 0.0
    model.params["lnfb"][...] = 1.0
    model.params["wte"][two] = 1.0          # ...so the logits are wte @ 1: token " 2" wins everywhere
    model.params_changed()
    t = Task("lm", "language_modeling", 0, " ", "x", 0.0,
             [{"context": "1 plus 1 equals", "continuation": "2"}, {"context": "1 plus 2 equals", "continuation": "3"},
              {"context": "x", "continuation": "2 2"}])
    assert [r["correct"] for r in core_eval.score_items(model, t, range(3))] == [True, False, True]
    # a training model (the full forward, arg max from its logits on the host: CORE during training) agrees
    train_model = GPT2(model.config, dtype="float64", init=False)
    for k, v in model.params.items():
        train_model.params[k][...] = v
    assert [r["correct"] for r in core_eval.score_items(train_model, t, range(3))] == [True, False, True]


def test_hellaswag_in_core_format_predicts_as_evaluate_hellaswag():
    """CORE's multiple choice over HellaSwag items (query = ctx, choices = endings, 0-shot, delimiter " ") gives the
    per-item predictions and mean losses of gpt2core.evaluate's HellaSwag scoring (acc_norm), on the items where the
    two rules coincide: no <|endoftext|> in front (bos=None; CORE puts one), endings without a common first token
    (CORE leaves a shared prefix out of the mean), and the same tokens whether ctx + " " + ending is encoded whole
    or in two parts."""
    items = hs.load_items(SUBSET, limit=24)
    model, _ = tiny_model(block=160)
    data = hs.render(items)
    data.tokens = data.tokens % SV  # the same fold as CORE's encode below
    sums, counts = hellaswag_losses(model, data, items_per_batch=4)
    norm = sums / counts
    task = Task("hellaswag_zeroshot", "multiple_choice", 0, " ", "x", 0.25,
                [{"query": it["ctx"], "choices": it["endings"], "gold": it["label"]} for it in items])
    got = core_eval.score_items(model, task, range(len(items)), bos=None, encode=fold)
    same = 0
    for i, it in enumerate(items):
        whole = fold([f"{it['ctx']} {e}" for e in it["endings"]])
        parts = [list(data.row(i, r)) for r in range(4)]
        if whole != parts or len({p[data.ctx_lens[i]] for p in parts}) == 1 or max(map(len, parts)) > 161:
            continue
        same += 1
        assert got[i]["pred"] == int(np.argmin(norm[i]))
        np.testing.assert_allclose(got[i]["scores"], norm[i], rtol=1e-10)
    assert same >= 15  # most items qualify


def test_evaluate_core_json_csv_and_ranks(bundle, tmp_path):
    model, p = tiny_model(block=96)
    tasks = core_eval.load_bundle(bundle)
    kw = dict(bos=0, encode=fold)
    r = core_eval.evaluate_core(model, tasks, batch_tokens=300, **kw)
    for t in tasks:
        items = core_eval.score_items(model, t, range(len(t.items)), **kw)
        acc = np.mean([x["correct"] for x in items])
        assert r["tasks"][t.label]["accuracy"] == pytest.approx(acc)
        assert r["tasks"][t.label]["centered"] == pytest.approx((acc - t.random_baseline) / (1 - t.random_baseline))
        assert r["tasks"][t.label]["n"] == len(t.items)
    assert r["core"] == pytest.approx(np.mean([x["centered"] for x in r["tasks"].values()]))

    class Identity:  # each rank's own counts (a real process group would sum them)
        def allreduce(self, buf, op):
            assert op == "sum" and buf.dtype == np.float32

    parts = [core_eval.evaluate_core(model, tasks, rank=k, world_size=2, comm=Identity(), **kw) for k in range(2)]
    for label, t in r["tasks"].items():
        assert sum(q["tasks"][label]["accuracy"] for q in parts) == pytest.approx(t["accuracy"])

    few = core_eval.evaluate_core(model, tasks, max_per_task=3, **kw)
    for t in tasks:  # the first 3 items in file order, each scored as in the full run
        want = np.mean([x["correct"] for x in core_eval.score_items(model, t, range(3), **kw)])
        assert few["tasks"][t.label]["n"] == 3 and few["tasks"][t.label]["accuracy"] == pytest.approx(want)

    # the command line: GPT-2's tokenizer, a model over its vocabulary, two short tasks of the zipped bundle
    big, _ = tiny_model(block=96, vocab=(V, VP))
    path = tmp_path / "m.bin"
    big.save(path)
    from gpt2core.evaluate import main
    js, cs = tmp_path / "core.json", tmp_path / "core.csv"
    assert main(["core", "--model", str(path), "--bundle", str(zip_bundle(bundle)), "--max-per-task", "2",
                 "--tasks", "mc_zeroshot", "lm", "--json", str(js), "--csv", str(cs), "--no-progress"]) == 0
    out = json.loads(js.read_text())
    assert set(out) == {"core", "tasks"} and list(out["tasks"]) == ["mc_zeroshot", "lm"]
    want = core_eval.evaluate_core(load_model(path), [t for t in tasks if t.label in ("mc_zeroshot", "lm")],
                                   max_per_task=2)
    assert out["core"] == pytest.approx(want["core"])
    for label, t in out["tasks"].items():
        assert {"accuracy", "centered", "random_baseline", "n"} <= set(t) and t["n"] == 2
        assert t["accuracy"] == want["tasks"][label]["accuracy"]
    rows = list(csv.reader(cs.open()))
    assert rows[0][:3] == ["Task", "Accuracy", "Centered"] and rows[-1][0] == "CORE"
    assert float(rows[-1][2]) == pytest.approx(out["core"], abs=1e-6)


@pytest.mark.parametrize("breakage, message", [
    (lambda b: (b / "core.yaml").unlink(), "no core.yaml"),
    (lambda b: (b / "eval_meta_data.csv").write_text("Eval Task,Random baseline\nmc_3shot,25\n"),
     "no 'Random baseline' for task 'mc_zeroshot'"),
    (lambda b: (b / "eval_data" / "lang" / "schema.jsonl").write_text('{"context_options": ["a"], '
                                                                       '"continuation": "b", "gold": 3}\n'),
     "schema.jsonl: line 1: 'gold' must be an index"),
    (lambda b: (b / "eval_data" / "sym" / "lm.jsonl").write_text('{"context": "a"}\n'),
     "lm.jsonl: line 1: a language_modeling item needs 'continuation'"),
    (lambda b: (b / "eval_data" / "world" / "mc.jsonl").unlink(), "mc.jsonl: missing from the bundle"),
    (lambda b: (b / "core.yaml").write_text(YAML.replace("[3]", "[9]")), "9 few-shot examples but only 7 items"),
])
def test_bad_bundles_name_the_file(tmp_path, breakage, message):
    b = write_bundle(tmp_path)
    breakage(b)
    with pytest.raises(BundleError, match=message.replace("[", r"\[").replace("(", r"\(")):
        core_eval.load_bundle(b)
