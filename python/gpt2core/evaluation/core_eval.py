"""CORE: DCLM's in-context-learning score of a base model (Li et al. 2024, "DataComp-LM", arXiv:2406.11794), as
nanochat's core_eval.py / base_eval.py compute it.

    python -m gpt2core.evaluate core --model out/model.bin --bundle eval_bundle [--max-per-task 100]
        [--json core.json] [--csv core.csv]          # also: gpt2core-eval core ...; torchrun/launch: data parallel

The eval bundle (nanochat's download: https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip, 25 MB;
gpt2core never downloads it) is a folder, or that zip itself, holding
    core.yaml            icl_tasks: a list of {label, dataset_uri, num_fewshot: [k], icl_task_type:
                         multiple_choice | schema | language_modeling, continuation_delimiter (default " ")}
    eval_meta_data.csv   one row per task: "Eval Task" (the label) and "Random baseline" (in percent)
    eval_data/<dataset_uri>   one JSON object per line:
        multiple_choice    {"query", "choices": [...], "gold": i}
        schema             {"context_options": [...], "continuation", "gold": i}
        language_modeling  {"context", "continuation"}

The rules (nanochat's, which reproduce DCLM's published numbers; each one is a function below):
  * few-shot examples: the items of the task are put in the order random.Random(1337).shuffle gives; the item at
    position p draws its k examples with random.Random(1234 + p).sample(every other position, k): reproducible, and
    never the item itself. --max-per-task N scores the first N items in file order, each with the examples the full
    run gives it (drawn from the whole task), so its per-item results are the full run's for those items.
  * prompts (fewshot_prefix / render_item): each example as "<query><delim><gold choice>\\n\\n" (schema: "<gold
    context option><delim><continuation>\\n\\n"; language modeling: "<context stripped><delim><continuation>\\n\\n"),
    then the item: one prompt per choice (multiple choice), per context option (schema), or the prompt without and
    with the continuation (language modeling; the one without is stripped of surrounding white space).
  * tokens: GPT-2 BPE of each whole prompt with <|endoftext|> (the GPT-2 tokenizer's BOS, as nanochat's
    get_bos_token_id finds it) in front. The scored span: multiple choice, the tokens after the longest common
    prefix of the choices' token rows; schema, the longest common suffix of the options' rows; language modeling,
    the tokens after the prompt without the continuation (when that is not a token prefix of the prompt with it,
    which nanochat asserts never happens, the common prefix of the two).
  * a row longer than the model's block_size keeps its last block_size tokens (the span moves with it).
  * multiple choice and schema: the prediction is the option of lowest mean loss per span token (the first on ties);
    language modeling: correct when greedy decoding reproduces every span token.
  * per task: accuracy; centered = (accuracy - b) / (1 - b) with b the random baseline as a fraction (the CSV's
    percent / 100); CORE = the mean of the centered scores over the tasks of core.yaml.

Scoring runs through the inference path (gpt2core.scoring.score_spans: batched KV-cache prefills). With several
ranks (launched by torchrun, python -m gpt2core.launch, srun or mpirun) rank r scores items i % world == r of every
task and the per-item results are summed over ranks.

Acceptance run (not measured here: no bundle and no GPT-2 weights on this machine): GPT-2 124M from Hugging Face
(``--model gpt2`` or a local copy of openai-community/gpt2) on the full bundle, against the CORE that nanochat's
base_eval prints for openai-community/gpt2 (nanochat's leaderboard quotes 0.256525 for GPT-2 1.5B, the "time to
GPT-2" target).
"""
from __future__ import annotations

import csv
import functools
import io
import json
import math
import random
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import tokenizer
from ..errors import ArgError, FileFormatError
from ..progress import bar
from .scoring import score_spans

BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
SHUFFLE_SEED = 1337     # the order the few-shot positions refer to
FEWSHOT_SEED = 1234     # + the item's position in that order
CHUNK_ITEMS = 256       # items tokenized and scored together (sorted by length within)


class BundleError(FileFormatError):
    """An eval bundle that cannot be used; the message names the file (and line) and what is wrong."""


@dataclass
class Task:
    label: str
    task_type: str
    num_fewshot: int
    delimiter: str
    dataset_uri: str
    random_baseline: float          # a fraction (the CSV's percent / 100)
    items: list = field(default_factory=list, repr=False)


# ------------------------------------------------------------------------------------------------ the bundle
class _Files:
    """Files of a bundle folder or zip, by path relative to the folder holding core.yaml."""

    def __init__(self, path):
        self.path = Path(path)
        if self.path.is_dir():
            roots = [self.path, self.path / "eval_bundle"]
            root = next((r for r in roots if (r / "core.yaml").is_file()), None)
            if root is None:
                raise BundleError(f"{self.path}: no core.yaml in it (nor in {self.path / 'eval_bundle'}): not an eval "
                                  f"bundle; nanochat's is {BUNDLE_URL}")
            self.root, self.zip, self.prefix = root, None, ""
        elif self.path.is_file():
            try:
                self.zip = zipfile.ZipFile(self.path)
            except (zipfile.BadZipFile, OSError) as e:
                raise BundleError(f"{self.path}: not a zip archive nor a folder ({e})") from None
            names = [n for n in self.zip.namelist() if n == "core.yaml" or n.endswith("/core.yaml")]
            if not names:
                raise BundleError(f"{self.path}: the zip holds no core.yaml: not an eval bundle")
            self.prefix = min(names, key=lambda n: n.count("/"))[:-len("core.yaml")]
            self.root = None
        else:
            raise BundleError(f"{self.path}: no such folder or zip; download the eval bundle ({BUNDLE_URL}) and pass "
                              "the zip or the folder it unpacks to")

    def where(self, rel: str) -> str:
        return str(self.root / rel) if self.zip is None else f"{self.path}:{self.prefix}{rel}"

    def read(self, rel: str) -> str:
        try:
            if self.zip is None:
                data = (self.root / rel).read_bytes()
            else:
                data = self.zip.read(self.prefix + rel)
        except (KeyError, FileNotFoundError):
            raise BundleError(f"{self.where(rel)}: missing from the bundle") from None
        except OSError as e:
            raise BundleError(f"{self.where(rel)}: cannot read it ({e.strerror or e})") from None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BundleError(f"{self.where(rel)}: invalid UTF-8 at byte {e.start}") from None


_FIELDS = {"multiple_choice": ("query", "choices", "gold"), "schema": ("context_options", "continuation", "gold"),
           "language_modeling": ("context", "continuation")}


def _check_item(item, task_type: str, where: str) -> dict:
    if not isinstance(item, dict):
        raise BundleError(f"{where}: expected a JSON object, got {type(item).__name__}")
    for f in _FIELDS[task_type]:
        if f not in item:
            raise BundleError(f"{where}: a {task_type} item needs {f!r} (has: {', '.join(item) or 'nothing'})")
    options = item.get("choices", item.get("context_options"))
    if options is not None and task_type != "language_modeling":
        name = "choices" if task_type == "multiple_choice" else "context_options"
        if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
            raise BundleError(f"{where}: {name!r} must be a non-empty list of strings")
        gold = item["gold"]
        if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(options):
            raise BundleError(f"{where}: 'gold' must be an index into {name!r} (0..{len(options) - 1}), got {gold!r}")
    for f in ("query", "context", "continuation"):
        if f in _FIELDS[task_type] and not isinstance(item[f], str):
            raise BundleError(f"{where}: {f!r} must be a string")
    return item


def _read_jsonl(text: str, task_type: str, where: str) -> list[dict]:
    items = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise BundleError(f"{where}: line {lineno}: not valid JSON ({e.msg})") from None
        items.append(_check_item(rec, task_type, f"{where}: line {lineno}"))
    if not items:
        raise BundleError(f"{where}: no items")
    return items


def _baselines(files: _Files) -> dict[str, float]:
    rel = "eval_meta_data.csv"
    rows = list(csv.DictReader(io.StringIO(files.read(rel))))
    if not rows or "Eval Task" not in rows[0] or "Random baseline" not in rows[0]:
        raise BundleError(f"{files.where(rel)}: needs the columns 'Eval Task' and 'Random baseline'")
    out = {}
    for i, r in enumerate(rows, start=2):
        try:
            out[r["Eval Task"].strip()] = float(r["Random baseline"]) / 100.0
        except (TypeError, ValueError):
            raise BundleError(f"{files.where(rel)}: line {i}: 'Random baseline' {r['Random baseline']!r} is not a "
                              "number (percent)") from None
    return out


def load_bundle(path, tasks=None) -> list[Task]:
    """The tasks of an eval bundle (a folder or its zip; see the module doc), with their items, in core.yaml's
    order; `tasks`: only these labels."""
    try:
        import yaml
    except ImportError as e:
        raise ImportError("CORE reads the bundle's core.yaml with PyYAML: pip install pyyaml (or 'gpt2core[eval]')") \
            from e
    files = _Files(path)
    try:
        conf = yaml.safe_load(files.read("core.yaml"))
    except yaml.YAMLError as e:
        raise BundleError(f"{files.where('core.yaml')}: not valid YAML ({e})") from None
    entries = conf.get("icl_tasks") if isinstance(conf, dict) else None
    if not isinstance(entries, list) or not entries:
        raise BundleError(f"{files.where('core.yaml')}: needs a non-empty list 'icl_tasks'")
    labels = [e.get("label") if isinstance(e, dict) else None for e in entries]
    if tasks is not None:
        unknown = sorted(set(tasks) - set(labels))
        if unknown:
            raise ArgError(f"tasks: {', '.join(unknown)} not in {files.where('core.yaml')} (its tasks: "
                           f"{', '.join(str(x) for x in labels)})")
    baselines = _baselines(files)
    out = []
    for i, e in enumerate(entries):
        where = f"{files.where('core.yaml')}: icl_tasks[{i}]"
        if not isinstance(e, dict) or not all(k in e for k in ("label", "dataset_uri", "icl_task_type",
                                                                 "num_fewshot")):
            raise BundleError(f"{where}: needs label, dataset_uri, icl_task_type and num_fewshot")
        if tasks is not None and e["label"] not in tasks:
            continue
        if e["icl_task_type"] not in TASK_TYPES:
            raise BundleError(f"{where}: icl_task_type {e['icl_task_type']!r} is not one of {', '.join(TASK_TYPES)}")
        k = e["num_fewshot"]
        k = k[0] if isinstance(k, list) and k else k  # DCLM lists the shot counts; CORE uses the first
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise BundleError(f"{where}: num_fewshot must be an integer >= 0 or a list of them, got "
                              f"{e['num_fewshot']!r}")
        label = str(e["label"])
        if label not in baselines:
            raise BundleError(f"{files.where('eval_meta_data.csv')}: no 'Random baseline' for task {label!r}")
        rel = f"eval_data/{e['dataset_uri']}"
        items = _read_jsonl(files.read(rel), e["icl_task_type"], files.where(rel))
        if k >= len(items):
            raise BundleError(f"{where}: {k} few-shot examples but only {len(items)} items in {files.where(rel)}")
        out.append(Task(label, e["icl_task_type"], k, str(e.get("continuation_delimiter", " ")), str(e["dataset_uri"]),
                        baselines[label], items))
    return out


# ------------------------------------------------------------------------------------------------ the rules
@functools.lru_cache(maxsize=8)
def _shuffled(n: int) -> tuple[list[int], list[int]]:
    """(order, position): order[p] = the file index at position p of random.Random(1337).shuffle, position[i] = p."""
    order = list(range(n))
    random.Random(SHUFFLE_SEED).shuffle(order)
    position = [0] * n
    for p, i in enumerate(order):
        position[i] = p
    return order, position


class _AllBut(Sequence):
    """range(n) without p, as a sequence (random.sample reads only len and items: the same draws as the list, without
    building n - 1 numbers per item)."""

    def __init__(self, n: int, p: int):
        self.n, self.p = n, p

    def __len__(self) -> int:
        return self.n - 1

    def __getitem__(self, j: int) -> int:
        if not 0 <= j < self.n - 1:
            raise IndexError(j)
        return j if j < self.p else j + 1


def fewshot_indices(n: int, i: int, k: int) -> list[int]:
    """The file indices of the k few-shot examples of item i of a task of n items (see the module doc)."""
    if k == 0:
        return []
    order, position = _shuffled(n)
    p = position[i]
    return [order[j] for j in random.Random(FEWSHOT_SEED + p).sample(_AllBut(n, p), k)]


def fewshot_prefix(task: Task, examples: list[dict]) -> str:
    d = task.delimiter
    if task.task_type == "multiple_choice":
        return "".join(f"{e['query']}{d}{e['choices'][e['gold']]}\n\n" for e in examples)
    if task.task_type == "schema":
        return "".join(f"{e['context_options'][e['gold']]}{d}{e['continuation']}\n\n" for e in examples)
    return "".join(f"{e['context'].strip()}{d}{e['continuation']}\n\n" for e in examples)


def render_item(task: Task, i: int) -> list[str]:
    """The prompts of item i: one per choice / context option, or [without, with] the continuation."""
    item, d = task.items[i], task.delimiter
    pre = fewshot_prefix(task, [task.items[j] for j in fewshot_indices(len(task.items), i, task.num_fewshot)])
    if task.task_type == "multiple_choice":
        return [f"{pre}{item['query']}{d}{c}" for c in item["choices"]]
    if task.task_type == "schema":
        return [f"{pre}{o}{d}{item['continuation']}" for o in item["context_options"]]
    head = f"{pre}{item['context'].strip()}{d}"
    return [head.strip(), head + item["continuation"]]


def _common(rows: list[list[int]], from_end: bool) -> int:
    n = min(len(r) for r in rows)
    for k in range(n):
        j = -1 - k if from_end else k
        if any(r[j] != rows[0][j] for r in rows):
            return k
    return n


def spans(task_type: str, rows: list[list[int]]) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """(the rows to score, their (start, end) spans) of one item's token rows (see the module doc)."""
    if task_type == "multiple_choice":
        s = _common(rows, from_end=False)
        return rows, [(s, len(r)) for r in rows]
    if task_type == "schema":
        k = _common(rows, from_end=True)
        return rows, [(len(r) - k, len(r)) for r in rows]
    without, with_ = rows
    s = len(without) if with_[:len(without)] == without else _common(rows, from_end=False)
    return [with_], [(s, len(with_))]


def crop(row: list[int], span: tuple[int, int], block_size: int):
    """A row longer than block_size keeps its last block_size tokens; the span moves with it (and keeps at least its
    last token: a span start before the first kept position starts at position 1)."""
    cut = len(row) - block_size
    if cut <= 0:
        return row, span
    s, e = span
    return row[cut:], (max(1, s - cut), max(1, e - cut))


def centered(accuracy: float, random_baseline: float) -> float:
    """(accuracy - b) / (1 - b): 0 at chance, 1 at perfect (b a fraction)."""
    return (accuracy - random_baseline) / (1.0 - random_baseline)


# ------------------------------------------------------------------------------------------------ scoring
def score_items(model, task: Task, item_ids, batch_tokens: int = 4096, bos: int | None = tokenizer.EOT,
                progress=None, encode=None) -> list[dict]:
    """Per item of item_ids: {"idx", "correct"} and, for multiple choice and schema, "gold", "pred" and "scores" (the
    mean loss per span token of each option). bos: the token put in front of every prompt (None: nothing); encode:
    list of texts -> list of token id lists (default: GPT-2's BPE, tokenizer.encode_batch)."""
    block = int(model.config.block_size)
    out = []
    item_ids = [int(i) for i in item_ids]
    for c0 in range(0, len(item_ids), CHUNK_ITEMS):
        chunk = item_ids[c0:c0 + CHUNK_ITEMS]
        prompts = [render_item(task, i) for i in chunk]
        flat = (encode or tokenizer.encode_batch)([p for ps in prompts for p in ps])
        if bos is not None:
            flat = [[bos] + r for r in flat]
        rows, sp, owner = [], [], []
        k = 0
        for j, ps in enumerate(prompts):
            r, s = spans(task.task_type, flat[k:k + len(ps)])
            k += len(ps)
            for row, span in zip(r, s):
                row, span = crop(row, span, block)
                rows.append(row)
                sp.append(span)
                owner.append(j)
        lm = task.task_type == "language_modeling"
        nll, n, greedy = score_spans(model, rows, sp, batch_tokens=batch_tokens, greedy=lm)
        owner = np.array(owner)
        for j, i in enumerate(chunk):
            sel = np.flatnonzero(owner == j)
            if lm:
                out.append({"idx": i, "correct": bool(greedy[sel[0]])})
                continue
            with np.errstate(invalid="ignore", divide="ignore"):
                means = [float(x) for x in nll[sel] / n[sel]]  # an empty span: NaN, as nanochat's mean of nothing
            pred = means.index(min(means))  # Python's min: nanochat's rule, NaN included
            gold = int(task.items[i]["gold"])
            out.append({"idx": i, "gold": gold, "pred": pred, "correct": pred == gold, "scores": means})
        if progress is not None:
            progress.update(len(chunk))
    return out


def evaluate_core(model, bundle, max_per_task: int | None = None, batch_tokens: int = 4096, rank: int = 0,
                  world_size: int = 1, comm=None, tasks=None, bos: int | None = tokenizer.EOT,
                  progress: bool = False, log=None, encode=None) -> dict:
    """CORE of a model over a bundle (a path or load_bundle's list): {"core": mean centered score, "tasks": {label:
    {"accuracy", "centered", "random_baseline", "n", "num_fewshot", "task_type"}}}. With world_size > 1 this rank
    scores items i % world_size == rank and comm (a gpt2core process group) sums the results over ranks; every
    rank returns the whole result. log: called with one line per task when given; bos, encode: as score_items."""
    if max_per_task is not None and (isinstance(max_per_task, bool) or not isinstance(max_per_task, int)
                                     or max_per_task < 1):
        raise ArgError(f"max_per_task must be an integer >= 1 (or None: every item), got {max_per_task!r}")
    if world_size > 1 and comm is None:
        raise ArgError("evaluate_core: world_size > 1 needs comm (the process group) to sum the results")
    task_list = load_bundle(bundle, tasks) if not isinstance(bundle, list) else bundle
    results = {}
    total = sum(min(len(t.items), max_per_task or len(t.items)) for t in task_list)
    with bar(total=math.ceil(total / world_size), enabled=progress, unit="item", desc="CORE") as pb:
        for t in task_list:
            n = min(len(t.items), max_per_task or len(t.items))
            correct = np.zeros(n, dtype=np.float32)  # 0/1 per item: summed over ranks exactly in float32
            for r in score_items(model, t, range(rank, n, world_size), batch_tokens, bos, pb, encode):
                correct[r["idx"]] = float(r["correct"])
            if comm is not None and world_size > 1:
                comm.allreduce(correct, "sum")
            acc = float(correct.sum()) / n
            results[t.label] = {"accuracy": acc, "centered": centered(acc, t.random_baseline),
                                "random_baseline": t.random_baseline, "n": n, "num_fewshot": t.num_fewshot,
                                "task_type": t.task_type}
            if log is not None:
                log(f"{t.label:<34} {t.num_fewshot:>2}-shot {t.task_type:<17} n={n:<6} accuracy {acc:.4f} "
                    f"centered {results[t.label]['centered']:+.4f}")
    core = float(np.mean([r["centered"] for r in results.values()]))
    return {"core": core, "tasks": results}


def write_csv(result: dict, path) -> Path:
    """Per-task results and the CORE line, as nanochat's base_eval writes them (Task, Accuracy, Centered), with the
    random baseline and item count beside."""
    from ..formats.atomic import atomic_write
    path = Path(path)
    with atomic_write(path, "w") as f:
        w = csv.writer(f)
        w.writerow(["Task", "Accuracy", "Centered", "Random baseline", "n"])
        for label, r in result["tasks"].items():
            w.writerow([label, f"{r['accuracy']:.6f}", f"{r['centered']:.6f}", f"{r['random_baseline']:.4f}", r["n"]])
        w.writerow(["CORE", "", f"{result['core']:.6f}", "", ""])
    return path


def write_json(result: dict, path) -> Path:
    """{"core": x, "tasks": {label: {"accuracy", "centered", "random_baseline", "n", ...}}}."""
    from ..formats.atomic import atomic_write
    path = Path(path)
    with atomic_write(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


__all__ = ["BUNDLE_URL", "BundleError", "Task", "load_bundle", "fewshot_indices", "fewshot_prefix", "render_item",
           "spans", "crop", "centered", "score_items", "evaluate_core", "write_csv", "write_json"]
