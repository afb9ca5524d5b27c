"""POST /v1/chat/completions as OpenAI's own Python client meets it: gpt2core-serve started as a process on
127.0.0.1 over the model fine-tuned on the synthetic task (chat_task.py), so the answers are the trained behaviour
(the two digits reversed): plain, streamed, stopped by a stop string or max_tokens; a bad role is a 400 naming the
field; a model without the chat tokens says so."""
import pytest

pytest.importorskip("starlette", reason="gpt2core[serve] (starlette) is not installed")
openai = pytest.importorskip("openai", reason="openai (requirements-dev.txt) is not installed")

import chat_task  # noqa: E402
from test_serve import Server, running  # noqa: E402


@pytest.fixture(scope="module")
def server():
    yield from running(chat_task.trained() / "run" / "model.bin")


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def ask(q):
    return [{"role": "user", "content": q}]


def test_plain_reply_is_the_trained_answer(client):
    r = client.chat.completions.create(model="m", messages=ask("3,4"), temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    c = r.choices[0]
    assert (c.message.role, c.message.content, c.finish_reason) == ("assistant", "4,3", "stop")
    # <|endoftext|><|user_start|>3,4<|user_end|><|assistant_start|>; "4", ",", "3", <|assistant_end|>
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (7, 4)


def test_streamed_reply_arrives_as_deltas(client):
    chunks = list(client.chat.completions.create(model="m", messages=ask("9,8"), temperature=0, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "8,9"
    assert len(chunks) >= 4 and chunks[-1].choices[0].finish_reason == "stop"


def test_stop_string_and_max_tokens_end_the_reply(client):
    r = client.chat.completions.create(model="m", messages=ask("9,8"), temperature=0, stop=[","])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("8", "stop")
    r = client.chat.completions.create(model="m", messages=ask("9,8"), temperature=0, max_tokens=2)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("8,", "length")


def test_bad_role_is_a_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "robot", "content": "hi"}])
    assert e.value.status_code == 400
    assert e.value.body["param"] == "messages[0].role" and "robot" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[])


def test_a_model_without_chat_tokens_refuses_chat_but_completes_text(tmp_path):
    from gpt2core import GPT2
    s = Server(GPT2(chat_task.CONFIG, seed=0).save(tmp_path / "base.bin"))
    try:
        r = s.client.post("/v1/chat/completions", json={"messages": ask("1,2")})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_chat"
        assert s.post(prompt="1,2", max_tokens=2).status_code == 200
    finally:
        s.client.close()
        s.stop()
