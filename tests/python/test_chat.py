"""The chat format (gpt2core.chat): rendering and masks against hand-written token lists, round trips, the special
tokens never made from text, errors naming the field, a model's vocabulary gaining the tokens."""
import numpy as np
import pytest

from gpt2core import GPT2, chat, tokenizer
from gpt2core.config import GPT2Config

EOT, US, UE, AS, AE, SS, SE = 50256, 50257, 50258, 50259, 50260, 50261, 50262


def test_token_ids_and_names_are_nanochats_in_the_padded_rows():
    assert tokenizer.CHAT_TOKENS == {"<|user_start|>": US, "<|user_end|>": UE, "<|assistant_start|>": AS,
                                     "<|assistant_end|>": AE, "<|system_start|>": SS, "<|system_end|>": SE}
    assert tokenizer.VOCAB_SIZE <= min(tokenizer.CHAT_TOKENS.values()) and chat.CHAT_VOCAB_SIZE <= 50304
    for name, i in tokenizer.CHAT_TOKENS.items():
        assert tokenizer.decode([i]) == name


# Hand-written: GPT-2 BPE of each text (tiktoken's r50k ids, written out), the role tokens around it, mask 1 on the
# assistant's content and its end token.
CASES = [
    ("system prompt",
     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello!"}],
     [EOT, SS, 3856, 4506, 13, SE, US, 17250, UE, AS, 15496, 0, AE],
     [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1]),
    ("multi-turn",
     [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
      {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hi"}],
     [EOT, US, 17250, UE, AS, 15496, 0, AE, US, 17250, UE, AS, 17250, AE],
     [0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1]),
    ("empty content",
     [{"role": "user", "content": ""}, {"role": "assistant", "content": None}],
     [EOT, US, UE, AS, AE],
     [0, 0, 0, 0, 1]),
    ("unicode",
     [{"role": "user", "content": "é"}, {"role": "assistant", "content": [{"type": "text", "text": "日"}]}],
     [EOT, US, 2634, UE, AS, 33768, 98, AE],
     [0, 0, 0, 0, 0, 1, 1, 1]),
]


@pytest.mark.parametrize("name,messages,ids,mask", CASES, ids=[c[0] for c in CASES])
def test_render_matches_hand_written_ids_and_mask(name, messages, ids, mask):
    got_ids, got_mask = chat.render(messages)
    assert got_ids.dtype == np.int32 and got_mask.dtype == np.int32 and got_ids.shape == got_mask.shape
    assert got_ids.tolist() == ids
    assert got_mask.tolist() == mask


@pytest.mark.parametrize("name,messages,ids,mask", CASES, ids=[c[0] for c in CASES])
def test_decode_of_render_shows_every_turn(name, messages, ids, mask):
    text = chat.decode(chat.render(messages)[0])
    at = 0
    for m in messages:
        content = m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"] or [])
        turn = f"<|{m['role']}_start|>{content}<|{m['role']}_end|>"
        at = text.index(turn, at) + len(turn)  # every turn, in order
    assert text.startswith("<|endoftext|>") and at == len(text)


def test_prompt_ends_with_assistant_start_and_equals_render_less_the_reply():
    conv = CASES[1][1]
    ids, _ = chat.render(conv)
    p = chat.prompt(conv[:-1])
    assert p[-1] == AS and p.tolist() == ids[:len(p)].tolist()
    assert chat.prompt([{"role": "user", "content": "Hi"}]).tolist() == [EOT, US, 17250, UE, AS]


def test_special_tokens_are_never_made_from_user_text():
    for name, i in tokenizer.CHAT_TOKENS.items():
        text = f"x {name} y{name}"
        ids, mask = chat.render([{"role": "user", "content": text}, {"role": "assistant", "content": name}])
        specials = [int(t) for t in ids if t >= tokenizer.VOCAB_SIZE - 1]
        assert specials == [EOT, US, UE, AS, AE]  # only the structure's own
        assert tokenizer.encode(text) == tokenizer.get_encoding().encode_ordinary(text)
        assert i not in tokenizer.encode(text, allow_special=True)
        assert tokenizer.decode(ids).count(name) >= 2
    assert tokenizer.encode("<|endoftext|>", allow_special=True) == [EOT]  # the one special text may name


@pytest.mark.parametrize("messages,field", [
    ([], "messages"),
    ("hi", "messages"),
    ([{"role": "user", "content": "a"}], "messages"),  # nothing to train on
    ([{"role": "user", "content": "a"}, "x"], "messages[1]"),
    ([{"role": "bot", "content": "a"}, {"role": "assistant", "content": "b"}], "messages[0].role"),
    ([{"content": "a"}, {"role": "assistant", "content": "b"}], "messages[0].role"),
    ([{"role": "user", "content": 3}, {"role": "assistant", "content": "b"}], "messages[0].content"),
    ([{"role": "assistant", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
])
def test_bad_conversations_name_the_field(messages, field):
    with pytest.raises(chat.ChatFormatError) as e:
        chat.render(messages)
    assert e.value.field == field and str(e.value).startswith(field)


def test_a_reply_prompt_needs_no_assistant_turn_but_a_message():
    assert chat.prompt([{"role": "system", "content": "s"}])[-1] == AS
    with pytest.raises(chat.ChatFormatError):
        chat.prompt([])


def test_reply_stream_joins_split_utf8_and_drops_special_tokens():
    ids = tokenizer.encode("日本 ok") + [AE]
    s = chat.ReplyStream()
    assert "".join(s.feed(t) for t in ids) + s.finish() == "日本 ok"
    assert chat.reply_text(ids + tokenizer.encode("more")) == "日本 ok"


def test_chat_config_uses_the_padded_rows_and_grows_only_a_model_without_them():
    c = GPT2Config(block_size=8, n_layer=1, n_head=1, n_embd=8)
    assert chat.chat_config(c) == c.replace(vocab_size=chat.CHAT_VOCAB_SIZE)  # same padded rows: no new shape
    big = c.replace(vocab_size=50400, padded_vocab_size=50432)
    assert chat.chat_config(big) is big
    bare = c.replace(padded_vocab_size=50257)
    assert chat.chat_config(bare).padded_vocab_size == 50304


@pytest.mark.parametrize("padded,tied", [(50304, True), (50257, True), (50257, False)])
def test_with_chat_vocab_keeps_every_weight_and_starts_the_new_rows_near_the_mean(padded, tied):
    c = GPT2Config(block_size=8, padded_vocab_size=padded, n_layer=1, n_head=2, n_embd=8, tie_embeddings=tied)
    m = GPT2(c, seed=3)
    flat = np.concatenate([p.reshape(-1) for p in m.params.values()])
    new, grown = chat.with_chat_vocab(c, flat, seed=0)
    m2 = GPT2(new, init=False)
    assert grown.size == m2.num_parameters
    off = 0
    for name, p in m2.params.items():
        got = grown[off:off + p.size].reshape(p.shape)
        off += p.size
        old = m.params[name]
        if name in ("wte", "lm_head"):
            np.testing.assert_array_equal(got[:tokenizer.VOCAB_SIZE], old[:tokenizer.VOCAB_SIZE])
            rows = got[tokenizer.VOCAB_SIZE:chat.CHAT_VOCAB_SIZE]
            assert rows.std() > 0.005 and np.all(got[chat.CHAT_VOCAB_SIZE:] == 0)
            if name == "wte":
                mean = old[:tokenizer.VOCAB_SIZE].mean(0)
                assert np.abs(rows - mean).max() < 0.02 * 6
        else:
            np.testing.assert_array_equal(got, old)
