"""Supervised fine-tuning on conversations (gpt2core-train --sft, gpt2core.data.sft): bad lines named by file, line
and field; packing that never splits a conversation and never scores padding; the masked loss and its gradient
against float64 numpy over the kept positions only; the loader's resume and data-parallel split; the command's own
defaults, validation and resume; and the synthetic task learned (chat_task.py), then used through GPT2.chat and
gpt2core-chat."""
import io
import json

import numpy as np
import pytest

import chat_task
import numpy_gpt2 as ref
from gpt2core import GPT2, chat, tokenizer
from gpt2core.config import GPT2Config, SFT_DEFAULTS
from gpt2core.data import sft
from gpt2core.llmc import fill_params
from gpt2core.train import build_parser, parse_args


def conversations(n, seed=0):
    """Random conversations of random lengths: system prompts, several turns, empty and unicode content."""
    rng = np.random.default_rng(seed)
    words = ["a", "bb", "ccc", "日本", "", "the cat", "4+5", "<|user_start|>"]
    out = []
    for _ in range(n):
        msgs = [{"role": "system", "content": "be kind"}] if rng.random() < 0.3 else []
        for _ in range(rng.integers(1, 4)):
            for role in ("user", "assistant"):
                msgs.append({"role": role, "content": " ".join(rng.choice(words, rng.integers(1, 6)))})
        out.append(msgs)
    return out


def write_jsonl(path, convs):
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs))
    return path


# ----------------------------------------------------------------------------------------------- reading
@pytest.mark.parametrize("line,where", [
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}', ":2: messages[1].role"),
    ('{"messages": [{"role": "user", "content": "a"}]}', ":2: messages: has no assistant"),
    ('{"msgs": []}', ":2: messages"),
    ('{"messages": [{"role": "user", "content": ["x"]}, {"role": "assistant"}]}', ":2: messages[0].content[0]"),
    ('{"messages": [', ":2: not valid JSON"),
])
def test_a_bad_line_is_one_error_naming_file_line_and_field(tmp_path, line, where):
    good = json.dumps({"messages": conversations(1)[0]})
    f = tmp_path / "d.jsonl"
    f.write_text(good + "\n" + line + "\n" + good + "\n")
    with pytest.raises(sft.SFTDataError) as e:
        sft.read_conversations(f)
    assert str(e.value).startswith(f"{f}{where}"), str(e.value)


def test_a_folder_reads_every_jsonl_in_name_order_and_skips_blank_lines(tmp_path):
    convs = conversations(5)
    write_jsonl(tmp_path / "b.jsonl", convs[3:])
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"messages": m}) for m in convs[:3]) + "\n\n")
    (tmp_path / "notes.txt").write_text("not read")
    assert sft.read_conversations(tmp_path) == convs
    (tmp_path / "empty").mkdir()
    with pytest.raises(sft.SFTDataError, match=r"empty: no \*\.jsonl files"):
        sft.read_conversations(tmp_path / "empty")


# ----------------------------------------------------------------------------------------------- packing
def test_packing_keeps_every_conversation_whole_in_one_row_and_scores_no_padding():
    convs = conversations(40, seed=1)
    rendered = [chat.render(m) for m in convs]
    T = 127
    p = sft.pack(rendered, T)
    assert p.ids.shape == (p.rows, T + 1) and p.truncated == 0 and p.conversations == 40
    left = {i: r for i, r in enumerate(rendered)}
    for r in range(p.rows):
        at = 0
        while True:  # the row is whole conversations, then padding
            hit = next((i for i, (ids, _) in left.items()
                        if at + len(ids) <= T + 1 and np.array_equal(p.ids[r, at:at + len(ids)], ids)
                        and np.array_equal(p.trained[r, at:at + len(ids)], left[i][1].astype(bool))), None)
            if hit is None:
                break
            at += len(left.pop(hit)[0])
        assert at > 0
        assert np.all(p.ids[r, at:] == sft.PAD) and not p.trained[r, at:].any()  # padding: never trained on
    assert not left  # every conversation placed exactly once
    assert p.tokens == sum(len(i) for i, _ in rendered)
    assert p.rows <= -(-p.tokens // (T + 1)) + 2  # best fit wastes little


def test_batches_ignore_every_target_not_trained_on():
    rendered = [chat.render(m) for m in conversations(20, seed=2)]
    p = sft.pack(rendered, 127)
    x, y = p.batch(np.arange(p.rows))
    assert x.dtype == y.dtype == np.int32 and x.shape == y.shape == (p.rows, 127) and p.truncated == 0
    np.testing.assert_array_equal(x, p.ids[:, :-1])
    expect = np.where(p.trained[:, 1:], p.ids[:, 1:].astype(np.int64), -1)
    np.testing.assert_array_equal(y, expect)
    # the targets kept are exactly the assistant's content and end tokens of every conversation
    assert (y >= 0).sum() == sum(int(m[1:].sum()) for _, m in rendered)
    assert set(y[y >= 0].tolist()) >= {chat.ASSISTANT_END}
    assert not np.isin(y[y >= 0], [chat.USER_START, chat.USER_END, chat.ASSISTANT_START, chat.BOS]).any()


def test_a_conversation_longer_than_a_row_is_cut_or_dropped():
    long_reply = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 40}]
    long_question = [{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "ok"}]
    p = sft.pack([chat.render(long_reply), chat.render(long_question)], 15)
    assert (p.truncated, p.dropped, p.conversations, p.rows) == (2, 1, 1, 1)
    assert p.ids[0, 0] == chat.BOS and p.trained[0].sum() == 16 - 5  # cut after 5 prompt tokens


def test_loader_splits_ranks_resumes_and_completes_the_last_batch():
    p = sft.pack([chat.render(m) for m in conversations(50, seed=3)], 31)
    assert p.dropped == 0
    one = sft.SFTLoader(p, "train", 2, 31, seed=5)
    ranks = [sft.SFTLoader(p, "train", 1, 31, rank=r, world_size=2, seed=5) for r in range(2)]
    for _ in range(one.batches_per_epoch + 2):  # past an epoch boundary
        x, y = one.next_batch()
        parts = [rk.next_batch() for rk in ranks]
        np.testing.assert_array_equal(x, np.concatenate([q[0] for q in parts]))
        np.testing.assert_array_equal(y, np.concatenate([q[1] for q in parts]))
        assert (y >= 0).any(axis=1).all()  # every row scores something
    state = json.loads(json.dumps(one.state_dict()))
    want = [one.next_batch()[1] for _ in range(3)]
    again = sft.SFTLoader(p, "train", 2, 31, seed=0)
    again.load_state_dict(state)
    for w in want:
        np.testing.assert_array_equal(again.next_batch()[1], w)
    with pytest.raises(ValueError, match="same conversations"):
        sft.SFTLoader(p, "train", 4, 31).load_state_dict(state)
    seen = sft.SFTLoader(p, "train", 2, 31, shuffle=False)
    rows = np.concatenate([seen.next_batch()[0] for _ in range(seen.batches_per_epoch)])
    assert len(rows) >= p.rows and np.array_equal(rows[:p.rows], p.ids[:, :-1])  # each row once, then wrapped


# ----------------------------------------------------------------------------------------------- the loss
def test_masked_loss_and_gradient_equal_float64_numpy_over_the_kept_positions():
    """A float64 model on packed conversation rows (-1 targets where not trained on) against numpy computing the
    mean cross-entropy of the kept positions only (the masked ones dropped from the sum and the count) and its
    gradient."""
    rng = np.random.default_rng(4)
    c = chat.chat_config(GPT2Config(block_size=24, n_layer=1, n_head=2, n_embd=8))
    p = sft.pack([chat.render(m) for m in conversations(6, seed=4)], 23)
    x, y = p.batch(np.arange(min(3, p.rows)))
    m = GPT2(c, dtype="float64", seed=1)
    for t in m.params.values():  # random everything, also the chat rows and LayerNorm gains
        t[...] = rng.standard_normal(t.shape) * 0.3
    params = {k: np.array(v, np.float64) for k, v in m.params.items()}
    loss = m.forward(x, y)
    m.zero_grad()
    m.backward()
    _, logits, _ = ref.forward(params, x, None, c.vocab_size, c.n_head)
    keep = np.nonzero(y >= 0)
    z = logits[keep][:, :c.vocab_size]
    lse = z.max(1) + np.log(np.exp(z - z.max(1, keepdims=True)).sum(1))
    want = float(np.mean(lse - z[np.arange(len(z)), y[keep]]))
    assert len(z) < y.size and abs(loss - want) < 1e-10 * max(1, abs(want))
    grads = ref.backward(params, x, y, c.vocab_size, c.n_head)
    for name, g in grads.items():
        np.testing.assert_allclose(m.grads[name], g, rtol=1e-8, atol=1e-11, err_msg=name)
    # the masked positions do not matter: other tokens there change neither the loss nor the gradient
    y2 = np.where(y >= 0, y, -100)
    m.zero_grad()
    assert m.forward(x, y2) == loss
    m.backward()
    np.testing.assert_allclose(m.grads["wte"], grads["wte"], rtol=1e-8, atol=1e-11)


# ----------------------------------------------------------------------------------------------- the command
def test_sft_defaults_are_printed_in_help_and_applied_unless_given():
    text = "".join(build_parser().format_help().split())  # argparse wraps lines anywhere between words
    for k, v in SFT_DEFAULTS.items():
        assert f"{k}={v}" in text
    cfg = parse_args(["--sft", __file__])
    assert {k: getattr(cfg, k) for k in SFT_DEFAULTS} == SFT_DEFAULTS
    cfg = parse_args(["--sft", __file__, "--lr", "3e-4", "--steps", "7"])
    assert (cfg.lr, cfg.steps, cfg.epochs, cfg.warmup) == (3e-4, 7, None, 0)
    plain = parse_args([])
    assert (plain.lr, plain.epochs, plain.warmup) != (SFT_DEFAULTS["lr"], SFT_DEFAULTS["epochs"], 0)


def test_sft_with_data_dir_or_epochs_without_sft_is_refused(tmp_path):
    from gpt2core.config import TrainConfig
    from gpt2core.errors import ArgError
    with pytest.raises(ArgError, match="give one of them"):
        TrainConfig(sft=__file__, data_dir=str(tmp_path))
    with pytest.raises(ArgError, match="--epochs"):
        TrainConfig(epochs=2)


def test_sft_run_validates_on_held_out_conversations_and_resumes_exactly(tmp_path):
    import shutil
    from gpt2core.train import main
    base = GPT2(GPT2Config(block_size=32, n_layer=1, n_head=1, n_embd=16), seed=0).save(tmp_path / "base.bin")
    data = chat_task.write_conversations(tmp_path / "c.jsonl", 40, seed=1)
    args = ["--sft", str(data), "--init", str(base), "-B", "2", "-T", "24", "--epochs", "1", "--val-every", "3",
            "--sample-tokens", "0", "--checkpoint-every", "3", "--sft-val-frac", "0.1"]
    full = main(args + ["--output-dir", str(tmp_path / "a")])
    recs = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    train_rows = sft.load(data, 24, 0.1, seed=1337)[0].rows  # the run's split and packing (its default seed)
    assert recs[0]["run"]["steps"] == len(steps) == -(-train_rows // 2) > 3  # --epochs 1: one pass over the rows
    vals = [r["val_loss"] for r in recs if "val_loss" in r]
    assert len(vals) >= 2 and all(np.isfinite(vals)) and vals[-1] == full["val_loss"]
    m = GPT2.from_pretrained(tmp_path / "a" / "model.bin")
    assert m.config.vocab_size == chat.CHAT_VOCAB_SIZE and m.config.padded_vocab_size == 50304
    # resumed from its step-3 checkpoint: the same last loss and weights as the run that did not stop
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    (tmp_path / "b" / "model.bin").unlink()
    res = main(args + ["--output-dir", str(tmp_path / "b"), "--resume",
                       str(tmp_path / "b" / "checkpoints" / "step_000003")])
    assert res["loss"] == full["loss"] and res["val_loss"] == full["val_loss"]
    np.testing.assert_array_equal(GPT2.from_pretrained(tmp_path / "b" / "model.bin").params["wte"], m.params["wte"])


# ----------------------------------------------------------------------------------------------- it learns
def test_sft_learns_the_synthetic_task_that_the_base_model_cannot_do():
    root = chat_task.trained()
    base = GPT2.from_pretrained(root / "base.bin")
    cfg, flat = chat.with_chat_vocab(base.config, np.concatenate([p.reshape(-1) for p in base.params.values()]),
                                     seed=1337)
    before = GPT2(cfg, init=False)
    fill_params(before, flat, "base")
    assert chat_task.exact_rate(before) == 0.0  # random weights: no answer, not even the format
    after = GPT2.from_pretrained(root / "run" / "model.bin")
    assert chat_task.exact_rate(after) >= 0.9


def test_gpt2_chat_and_the_terminal_chat_answer_with_the_trained_behaviour():
    from gpt2core import chat_cli
    root = chat_task.trained()
    path = str(root / "run" / "model.bin")
    model = GPT2.from_pretrained(path, training=False)
    assert model.chat([{"role": "user", "content": "3,4"}], top_k=1) == "4,3"
    pieces = list(model.chat([{"role": "user", "content": "2,7"}], top_k=1, stream=True))
    assert "".join(pieces) == "7,2" and len(pieces) == 3  # one piece per token, <|assistant_end|> not shown
    out = io.StringIO()
    msgs = chat_cli.main(["--model", path, "--top-k", "1"], stdin=io.StringIO("3,4\n1,2\n"), stdout=out)
    assert "assistant: 4,3" in out.getvalue().splitlines()
    assert [m["role"] for m in msgs] == ["user", "assistant"] * 2 and msgs[:3] == [  # the conversation is kept
        {"role": "user", "content": "3,4"}, {"role": "assistant", "content": "4,3"}, {"role": "user", "content": "1,2"}]
    out = io.StringIO()
    msgs = chat_cli.main(["--model", path, "--top-k", "1"], stdin=io.StringIO("3,4\n/clear\n\n6,0\n/quit\n5,5\n"),
                         stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[1:] == ["assistant: 4,3", "(new conversation)", "assistant: 0,6"]
    assert msgs == [{"role": "user", "content": "6,0"}, {"role": "assistant", "content": "0,6"}]


def test_chat_refuses_a_model_without_the_chat_tokens():
    from gpt2core.errors import ArgError
    with pytest.raises(ArgError, match="--sft"):
        GPT2(chat_task.CONFIG, seed=0).chat([{"role": "user", "content": "hi"}])


# ----------------------------------------------------------------------------------------------- issue 46
def test_T_beyond_an_init_models_block_size_names_that_model_and_the_advice_works(tmp_path):
    """The shape of an --init model is the file's: -T beyond its block size names that model and its block size,
    and says -T <= it (raising --block-size, the preset's advice, changes nothing with --init). Following the
    advice trains."""
    from gpt2core.train import main
    base = GPT2(GPT2Config(block_size=32, n_layer=1, n_head=1, n_embd=16), seed=0).save(tmp_path / "base.bin")
    data = chat_task.write_conversations(tmp_path / "c.jsonl", 20, seed=1)
    args = ["--sft", str(data), "--init", str(base), "-B", "1", "--steps", "1", "--val-every", "0",
            "--sample-tokens", "0", "--no-progress"]
    for extra in (["-T", "1024"], ["-T", "64", "--block-size", "64"]):  # the second: the old advice, followed
        with pytest.raises(SystemExit) as e:
            main(args + extra + ["--output-dir", str(tmp_path / "a")])
        assert e.value.code == 2 and str(e.value) == (
            f"gpt2core-train: error: -T {extra[1]} exceeds the block size 32 of the --init model {base} (its shape "
            "comes from the file; --preset and --block-size do not change it): use -T 32 or less")
    main(args + ["-T", "32", "--output-dir", str(tmp_path / "b")])
    assert GPT2.from_pretrained(tmp_path / "b" / "model.bin").config.block_size == 32


def test_the_sample_after_sft_is_the_models_chat_reply(tmp_path, capsys):
    """The sample an --sft run prints is the reply in the chat format to --sample-prompt as a user message (the
    text GPT2.chat gives from the saved model with the same seed and top-k), not a plain continuation; a blank
    prompt (the default) asks SFT_SAMPLE_PROMPT."""
    from gpt2core.train import main
    from gpt2core.training.trainer import SFT_SAMPLE_PROMPT
    base = GPT2(GPT2Config(block_size=32, n_layer=1, n_head=1, n_embd=16), seed=0).save(tmp_path / "base.bin")
    data = chat_task.write_conversations(tmp_path / "c.jsonl", 20, seed=1)
    for prompt, asked in (("2,3", "2,3"), (None, SFT_SAMPLE_PROMPT)):
        out = tmp_path / f"run{prompt is None}"
        main(["--sft", str(data), "--init", str(base), "-B", "2", "-T", "24", "--steps", "2", "--val-every", "0",
              "--sample-tokens", "6", "--seed", "5", "--no-progress", "--output-dir", str(out)]
             + (["--sample-prompt", prompt] if prompt else []))
        last = capsys.readouterr().out.strip().splitlines()[-1]
        want = GPT2.from_pretrained(out / "model.bin").chat([{"role": "user", "content": asked}], 6, top_k=50,
                                                            seed=5)
        assert last == f"sample (reply to {asked!r}): {want!r}"
