"""The streaming clients that time a server (gpt2core.inference.stream_clients: the lease's serve step and
scripts/bench_serve.py), against a stub server written here that streams exactly what a test asks for: each request
seen by the server with the streaming fields, tokens from the usage record or else counted chunks, the time to the
first chunk with text, the delays, and a failed or empty response reported from the caller's thread. The real server
behind them is the dry run's serve step (test_calibrate.py)."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gpt2core.inference.stream_clients import stream_burst
from gpt2core.runtime.lease_steps.serving import _round

CHUNK_S = 0.05  # between chunks: a response of n tokens takes n x 50 ms


class Stub(BaseHTTPRequestHandler):
    """POST /v1/completions: prompt[0] says what to answer: 0 text chunks and a usage record of max_tokens + 7
    (so a count of chunks cannot pass for it), 1 the chunks without usage, 2 an HTTP 500, 3 no text at all."""
    seen: list = []

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append((time.monotonic(), body))
        how, n = body["prompt"][0], body["max_tokens"]
        if how == 2:
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(n if how != 3 else 0):
            time.sleep(CHUNK_S)
            self.wfile.write(b"data: " + json.dumps({"choices": [{"text": "a"}]}).encode() + b"\n\n")
        self.wfile.write(b"data: " + json.dumps({"choices": [{"text": ""}]}).encode() + b"\n\n")
        if how in (0, 3):
            self.wfile.write(b"data: " + json.dumps({"choices": [], "usage": {"completion_tokens": n + 7}}).encode()
                             + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture()
def url():
    Stub.seen = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_a_burst_is_sent_at_one_moment_and_counted(url):
    bodies = [{"prompt": [0, i], "max_tokens": 3 + i, "temperature": 0} for i in range(4)]
    outs, wall = stream_burst(url, bodies)
    assert len(Stub.seen) == 4
    for _, body in Stub.seen:  # what the server got: the body as given, streamed with a usage record asked for
        i = body["prompt"][1]
        assert body == dict(bodies[i], stream=True, stream_options={"include_usage": True})
    arrived = sorted(t for t, _ in Stub.seen)
    assert arrived[-1] - arrived[0] < 3 * CHUNK_S  # together; one after another: >= 12 chunks late
    assert [o["tokens"] for o in outs] == [3 + 7, 4 + 7, 5 + 7, 6 + 7]  # the usage record's, not the chunks
    for o in outs:
        assert CHUNK_S * 0.9 <= o["ttft"] < o["end"] - o["start"] <= wall
    assert wall >= 6 * CHUNK_S * 0.9  # the slowest response's chunks


def test_without_usage_the_text_chunks_are_counted_and_delays_apply(url):
    outs, _ = stream_burst(url, [{"prompt": [1], "max_tokens": 5}, {"prompt": [1], "max_tokens": 2}], [0.0, 0.3])
    assert [o["tokens"] for o in outs] == [5, 2]  # the empty chunk is not a token
    assert outs[1]["start"] - outs[0]["start"] >= 0.3 * 0.95


def test_a_failed_request_raises_in_the_caller_naming_it(url):
    with pytest.raises(RuntimeError, match=r"1 of 3 streamed requests failed: HTTPStatusError.*500"):
        stream_burst(url, [{"prompt": [0], "max_tokens": 1}, {"prompt": [2], "max_tokens": 1},
                           {"prompt": [0], "max_tokens": 1}])


def test_the_serve_step_refuses_a_response_without_text(url):
    outs, wall = _round(url, [[0, 1], [0, 2]], 3)
    assert [o["tokens"] for o in outs] == [10, 10] and all(o["ttft"] > 0 for o in outs) and wall > 0
    with pytest.raises(RuntimeError, match="1 of 2 streamed requests sent no text"):
        _round(url, [[0], [3]], 3)
