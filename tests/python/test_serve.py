"""gpt2core-serve as a user meets it: the installed console script started as a process on 127.0.0.1 (a free port
it picks and prints), a tiny model file written by the package's own save, and a real HTTP client (httpx) — plus
the page at / driven in Debian's headless chromium (selenium + chromium-driver).

The reference for the text: greedy decoding (temperature 0) recomputed here from the model's full forward, so the
server's batching, streaming and text assembly are checked against the model itself."""
import json
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest

pytest.importorskip("starlette", reason="gpt2core[serve] (starlette) is not installed")
pytest.importorskip("uvicorn", reason="gpt2core[serve] (uvicorn) is not installed")
httpx = pytest.importorskip("httpx", reason="httpx (requirements-dev.txt) is not installed")

from gpt2core import GPT2, _C, tokenizer  # noqa: E402
from gpt2core.config import GPT2Config  # noqa: E402
from gpt2core.model import load_model  # noqa: E402
from gpt2core.serve import TextStream  # noqa: E402
from test_console_scripts import command  # noqa: E402

# GPT-2's vocabulary (the server speaks its tokenizer), a small body, and a context long enough that a stream of
# 4000 tokens (seconds, even on an idle machine) outlives by far a client that leaves after its first chunk
CONFIG = GPT2Config(block_size=4096, vocab_size=50257, padded_vocab_size=50304, n_layer=2, n_head=2, n_embd=64)
START_TIMEOUT = 120
LONG = 4000  # tokens of a stream that its client leaves


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    return GPT2(CONFIG, seed=3).save(tmp_path_factory.mktemp("serve") / "tiny.bin")


class Server:
    def __init__(self, model_file, *args, env=None, headers=None):
        self.proc = subprocess.Popen([command("gpt2core-serve"), "--model", str(model_file), "--port", "0",
                                      "--threads", "1", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines = []
        ready = threading.Event()

        def read():  # keep draining the output so the server never blocks on a full pipe
            for line in self.proc.stdout:
                self.lines.append(line)
                if "listening on http://" in line:
                    self.url = line.split("listening on ")[1].split()[0]
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(START_TIMEOUT) or not hasattr(self, "url"):
            self.stop()
            raise AssertionError("gpt2core-serve did not start:\n" + "".join(self.lines))
        self.client = httpx.Client(base_url=self.url, timeout=60, headers=headers)

    def post(self, **body):
        return self.client.post("/v1/completions", json=body)

    def health(self):
        r = self.client.get("/health")
        assert r.status_code == 200
        return r.json()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def running(model_file, *args):
    """A Server for a fixture to yield from: stopped afterwards, which must be a clean shutdown."""
    s = Server(model_file, *args)
    yield s
    s.client.close()
    s.stop()
    # SIGTERM: a clean shutdown, exit 0 (test_serve_edges.py: streams ended, waiting requests answered)
    assert s.proc.returncode == 0 and "Traceback" not in "".join(s.lines), "".join(s.lines)


@pytest.fixture(scope="module")
def server(model_file):
    yield from running(model_file)


@pytest.fixture(scope="module")
def greedy(model_file):
    """Greedy continuation of a prompt from the model's full forward: the reference text."""
    model = load_model(model_file)
    threads = _C.get_num_threads()
    _C.set_num_threads(1)  # two OpenMP threads spin-wait ~10x longer on a loaded 2-core machine

    def run(prompt: str, n: int) -> str:
        ids = tokenizer.encode(prompt)
        out = []
        for _ in range(n):
            _, logits = model.forward(np.array([ids + out], np.int32), return_logits=True)
            t = int(np.argmax(logits[0, -1, :CONFIG.vocab_size]))
            if t == tokenizer.EOT:
                break
            out.append(t)
        return tokenizer.decode(out)

    yield run
    _C.set_num_threads(threads)


def sse_events(response) -> list:
    """The `data:` payloads of a server-sent event stream, parsed (the final "[DONE]" kept as the string)."""
    events, buf = [], ""
    for text in response.iter_text():
        buf += text
        while "\n\n" in buf:
            block, buf = buf.split("\n\n", 1)
            for line in block.split("\n"):
                assert line.startswith("data: "), f"not an SSE data line: {line!r}"
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    assert buf == "", f"stream ended inside an event: {buf!r}"
    return events


# ---------------------------------------------------------------------------------------------------- completions
def test_completion_is_the_models_greedy_text(server, greedy):
    prompt = "The quick brown fox"
    r = server.post(prompt=prompt, max_tokens=12, temperature=0)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["text"] == greedy(prompt, 12)
    n_prompt = len(tokenizer.encode(prompt))
    assert body["usage"]["prompt_tokens"] == n_prompt
    assert body["usage"]["total_tokens"] == n_prompt + body["usage"]["completion_tokens"]
    if choice["finish_reason"] == "length":
        assert body["usage"]["completion_tokens"] == 12
    else:  # the model chose <|endoftext|>
        assert choice["finish_reason"] == "stop"


def test_prompt_list_and_seeds(server):
    prompts = ["Once upon a time", "A", "Numbers: 1, 2, 3,"]
    r = server.post(prompt=prompts, max_tokens=9, seed=11, temperature=1.0, top_p=0.9)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    # a seed reproduces the text; prompt i of the list gets the text it gets alone under that request's seed
    again = server.post(prompt=prompts, max_tokens=9, seed=11, temperature=1.0, top_p=0.9).json()["choices"]
    assert [c["text"] for c in again] == [c["text"] for c in choices]
    other = server.post(prompt=prompts, max_tokens=9, seed=12, temperature=1.0, top_p=0.9).json()["choices"]
    assert [c["text"] for c in other] != [c["text"] for c in choices]
    # token ids are a prompt too
    ids = tokenizer.encode(prompts[0])
    by_ids = server.post(prompt=ids, max_tokens=5, temperature=0).json()["choices"][0]["text"]
    assert by_ids == server.post(prompt=prompts[0], max_tokens=5, temperature=0).json()["choices"][0]["text"]


def test_stop_string_ends_the_text_before_it(server, greedy):
    prompt = "In the beginning"
    full = greedy(prompt, 20)
    stop = full[len(full) // 2:len(full) // 2 + 3]  # a piece from the middle, likely across a token boundary
    assert stop
    want = full[:full.find(stop)]
    r = server.post(prompt=prompt, max_tokens=20, temperature=0, stop=[stop, "\u2603never"]).json()
    assert r["choices"][0]["text"] == want and r["choices"][0]["finish_reason"] == "stop"
    with server.client.stream("POST", "/v1/completions", json=dict(prompt=prompt, max_tokens=20, temperature=0,
                                                                  stop=stop, stream=True)) as resp:
        events = sse_events(resp)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_text_stream_holds_back_stop_strings_and_split_characters():
    """TextStream alone: token by token, the text it releases never shows a stop string or half a character,
    and ends exactly before the first stop string, for stop strings at every offset of a text with multi-byte
    characters that GPT-2's byte-level BPE splits across tokens."""
    text = "naïve café — 日本語 test 🙂 end, and more text here."
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # some tokens are parts of a character
    for stops in ([], *([text[i:i + k]] for k in (1, 2, 5) for i in range(0, len(text) - k, 3)), ["zz", "é —"]):
        ts = TextStream(stops)
        got = []
        for t in ids:
            piece = ts.feed(t)
            assert "\ufffd" not in piece
            got.append(piece)
            if ts.stopped:
                break
        got.append(ts.finish())
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
        assert "".join(got) == text[:cut], stops


def test_streaming_sends_the_same_text_in_chunks(server):
    req = dict(prompt=["Hello there", "x"], max_tokens=15, seed=5, temperature=0.8)
    whole = server.post(**req).json()
    with server.client.stream("POST", "/v1/completions", json=dict(req, stream=True,
                                                                  stream_options={"include_usage": True})) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    chunks = events[:-2]
    assert all(e["id"] == chunks[0]["id"] and e["object"] == "text_completion" for e in chunks)
    for i in range(2):
        mine = [e["choices"][0] for e in chunks if e["choices"][0]["index"] == i]
        assert len([c for c in mine if c["text"]]) >= 2  # streamed, not sent at the end
        assert "".join(c["text"] for c in mine) == whole["choices"][i]["text"]
        assert [c["finish_reason"] for c in mine][-1] == whole["choices"][i]["finish_reason"]
        assert all(c["finish_reason"] is None for c in mine[:-1])


def test_client_that_leaves_mid_stream_stops_its_sequence(server):
    before = server.health()
    client = httpx.Client(base_url=server.url, timeout=60)
    with client.stream("POST", "/v1/completions",
                       json=dict(prompt="Tell me a long story", max_tokens=LONG, stream=True)) as resp:
        # one chunk, then gone: dropping the line iterator of an unfinished response already closes the connection
        first = next(resp.iter_lines())
        assert first.startswith("data: ") and "error" not in json.loads(first[6:])
    client.close()
    deadline = time.monotonic() + 60
    # until the model thread has seen the cancel (running alone can read 0 before its first iteration ends)
    while ((h := server.health())["running"] or h["cancelled"] == before["cancelled"]) and \
            time.monotonic() < deadline:
        time.sleep(0.02)
    log = "".join(server.lines)
    assert h["running"] == 0 and h["cancelled"] == before["cancelled"] + 1, (h, log)
    assert h["tokens"] - before["tokens"] < LONG, ("the sequence ran to max_tokens after its client left", h, log)
    # and the server keeps serving
    r = server.post(prompt="Still there?", max_tokens=3)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_client_that_leaves_before_a_json_answer_stops_its_sequence(server):
    """The same without streaming: the client sends its request, waits until /health says the model is running it
    (so the event loop answers while the model thread generates) and closes the connection."""
    import socket
    before = server.health()
    host, port = server.url.split("//")[1].rsplit(":", 1)
    body = json.dumps(dict(prompt="Another long story", max_tokens=LONG)).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 60
        while not (running := server.health()["running"]) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert running == 1, "".join(server.lines)
    deadline = time.monotonic() + 60
    while (h := server.health())["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    log = "".join(server.lines)
    assert h["running"] == 0 and h["cancelled"] == before["cancelled"] + 1, (h, log)
    assert h["tokens"] - before["tokens"] < LONG, ("the sequence ran to max_tokens after its client left", h, log)
    assert server.post(prompt="Still there?", max_tokens=3).status_code == 200


# ---------------------------------------------------------------------------------------------------- bad requests
BAD = [
    # (body sent as is, expected status, expected param, a word the message must contain)
    (b'{"prompt": "hi", ', 400, None, "JSON"),
    (b'["prompt"]', 400, None, "object"),
    (b'{"prompt": "hi", "max_tokens": NaN}', 400, None, "NaN"),
    (b'\xff\xfe', 400, None, "JSON"),
    (json.dumps({"max_tokens": 5}).encode(), 400, "prompt", "prompt"),
    (json.dumps({"prompt": 42}).encode(), 400, "prompt", "prompt"),
    (json.dumps({"prompt": []}).encode(), 400, "prompt", "prompt"),
    (json.dumps({"prompt": ["ok", 7]}).encode(), 400, "prompt", "prompt[1]"),
    (json.dumps({"prompt": [1, 2, 60000]}).encode(), 400, "prompt", "60000"),
    (json.dumps({"prompt": "hi", "max_tokens": 0}).encode(), 400, "max_tokens", "max_tokens"),
    (json.dumps({"prompt": "hi", "max_tokens": -3}).encode(), 400, "max_tokens", "max_tokens"),
    (json.dumps({"prompt": "hi", "max_tokens": 10**12}).encode(), 400, "max_tokens", "context length"),
    (json.dumps({"prompt": "hi", "max_tokens": 1e30}).encode(), 400, "max_tokens", "integer"),
    (json.dumps({"prompt": "hi", "max_tokens": "5"}).encode(), 400, "max_tokens", "integer"),
    (json.dumps({"prompt": "hi", "max_tokens": True}).encode(), 400, "max_tokens", "integer"),
    (json.dumps({"prompt": "hi " * 4200}).encode(), 400, "prompt", "context length"),
    (json.dumps({"prompt": "hi", "max_tokens": 4096}).encode(), 400, "max_tokens", "context length"),
    (json.dumps({"prompt": "hi", "temperature": "hot"}).encode(), 400, "temperature", "temperature"),
    (json.dumps({"prompt": "hi", "temperature": -0.5}).encode(), 400, "temperature", "temperature"),
    (json.dumps({"prompt": "hi", "top_p": 0}).encode(), 400, "top_p", "top_p"),
    (json.dumps({"prompt": "hi", "top_p": 1.5}).encode(), 400, "top_p", "top_p"),
    (json.dumps({"prompt": "hi", "stream": "yes"}).encode(), 400, "stream", "stream"),
    (json.dumps({"prompt": "hi", "stop": 5}).encode(), 400, "stop", "stop"),
    (json.dumps({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}).encode(), 400, "stop", "stop"),
    (json.dumps({"prompt": "hi", "seed": -1}).encode(), 400, "seed", "seed"),
    (json.dumps({"prompt": "hi", "seed": 1.5}).encode(), 400, "seed", "seed"),
    (json.dumps({"prompt": "hi", "n": 2}).encode(), 400, "n", "n must be 1"),
    (json.dumps({"prompt": "hi", "logprobs": 6}).encode(), 400, "logprobs", "logprobs"),
    (json.dumps({"prompt": "hi", "logprobs": True}).encode(), 400, "logprobs", "logprobs"),
    (json.dumps({"prompt": "hi", "echo": 1}).encode(), 400, "echo", "echo"),
    (json.dumps({"prompt": "hi", "max_tokens": -1, "echo": True}).encode(), 400, "max_tokens", ">= 0"),
    (json.dumps({"prompt": "hi", "stream_options": {"include_usage": True}}).encode(), 400, "stream_options",
     "stream"),
    (json.dumps({"prompt": ["a"] * 9}).encode(), 400, "prompt", "--max-batch"),
    (b'{"prompt": "' + b"x" * (1 << 21) + b'"}', 413, None, "limit"),
]


@pytest.mark.parametrize("raw,status,param,word", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_requests_get_a_clear_4xx(server, raw, status, param, word):
    r = server.client.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and word.lower() in err["message"].lower(), err
    if "context length" in word:
        assert err["code"] == "context_length_exceeded"


def test_server_keeps_serving_after_bad_requests_and_other_routes(server):
    for raw, *_ in BAD[:5]:
        server.client.post("/v1/completions", content=raw)
    assert server.client.get("/v1/completions").status_code == 405
    r = server.client.get("/nowhere")
    assert r.status_code == 404 and "/nowhere" in r.json()["error"]["message"]
    assert server.post(prompt="fine", max_tokens=2).status_code == 200
    page = server.client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/v1/completions" in page.text


# ---------------------------------------------------------------------------------------------------- the command
def run_cli(*args):
    return subprocess.run([command("gpt2core-serve"), *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args,flag", [(["--port", "70000"], "--port"), (["--port", "http"], "--port"),
                                       (["--max-batch", "0"], "--max-batch"), (["--threads", "100000"], "--threads"),
                                       (["--prefill-chunk", "0"], "--prefill-chunk"),
                                       (["--api-key-file", "/nonexistent/keys"], "--api-key-file"),
                                       (["--device", "gpu"], "--device")])
def test_bad_flags_exit_2_naming_the_flag(model_file, args, flag):
    p = run_cli("--model", model_file, *args)
    assert p.returncode == 2 and flag in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_unreadable_model_and_taken_port_are_one_line_failures(tmp_path, server):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\0" * 100)
    p = run_cli("--model", bad, "--port", "0")
    assert p.returncode == 1 and "bad.bin" in p.stderr and "Traceback" not in p.stderr, p.stderr
    other_vocab = GPT2(CONFIG.replace(vocab_size=1000, padded_vocab_size=1024), seed=0).save(tmp_path / "v1000.bin")
    p = run_cli("--model", other_vocab, "--port", "0")
    assert p.returncode == 2 and "v1000.bin" in p.stderr and "vocab_size is 1000" in p.stderr, p.stderr
    port = server.url.rsplit(":", 1)[1]
    p = run_cli("--model", bad, "--port", port)
    assert p.returncode == 1 and f"--port {port}" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


# ---------------------------------------------------------------------------------------------------- the page
def _browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip("Debian's chromium and chromium-driver are not installed (apt-get install chromium "
                    "chromium-driver; .ci/run installs them)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium (requirements-dev.txt) is not installed")
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        opts.add_argument(a)
    return webdriver.Chrome(options=opts, service=Service(executable_path=driver))


def test_page_streams_a_completion_in_a_headless_browser(server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    browser = _browser()
    try:
        browser.get(server.url + "/")
        prompt = "Hello from the browser"
        box = browser.find_element(By.ID, "prompt")
        box.clear()
        box.send_keys(prompt)
        for name, value in (("max_tokens", "40"), ("seed", "9"), ("temperature", "1")):
            el = browser.find_element(By.ID, name)
            el.clear()
            el.send_keys(value)
        # record every length the completion's text takes as chunks arrive
        browser.execute_script("""
            window.__lengths = [];
            new MutationObserver(() => {
              const c = document.getElementById('completion');
              if (c) window.__lengths.push(c.textContent.length);
            }).observe(document.getElementById('output'), {subtree: true, childList: true, characterData: true});""")
        browser.find_element(By.ID, "submit").click()
        WebDriverWait(browser, 120).until(
            lambda b: b.find_element(By.ID, "output").get_attribute("data-state") in ("done", "error"))
        out = browser.find_element(By.ID, "output")
        assert out.get_attribute("data-state") == "done", browser.find_element(By.ID, "status").text
        text = browser.execute_script("return document.getElementById('completion').textContent")
        lengths = browser.execute_script("return window.__lengths")
        assert browser.execute_script("return document.querySelector('#output .prompt').textContent") == prompt
    finally:
        browser.quit()
    want = server.post(prompt=prompt, max_tokens=40, seed=9, temperature=1, top_p=1).json()["choices"][0]["text"]
    assert text == want
    grew = sorted(set(n for n in lengths if n > 0))
    assert len(grew) >= 2 and grew[-1] == len(text), lengths  # the text arrived in pieces
