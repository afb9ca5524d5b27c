"""gpt2core-serve at its edges (issue 38), driven with raw sockets and real signals against the installed console
script: the body size limit enforced while the body arrives (by Content-Length before any of it is read, by
counting the chunks of a chunked body), a read timeout for a body that never comes, a client that leaves quietly
(no traceback), a JSON nesting limit, and SIGINT / SIGTERM during a live stream: the stream ends with an error
event, the process exits 0 and prints no traceback."""
import json
import signal
import socket
import time

import pytest

pytest.importorskip("starlette", reason="gpt2core[serve] (starlette) is not installed")
pytest.importorskip("uvicorn", reason="gpt2core[serve] (uvicorn) is not installed")
pytest.importorskip("httpx", reason="httpx (requirements-dev.txt) is not installed")

from gpt2core.serve import DRAIN_MAX, MAX_BODY, MAX_DEPTH, json_depth  # noqa: E402
from test_serve import LONG, Server, model_file  # noqa: E402,F401  (model_file: fixture)

BODY_TIMEOUT = 1.5  # --body-timeout of the server under test (seconds)


@pytest.fixture(scope="module")
def edge_server(model_file):  # noqa: F811
    s = Server(model_file, "--body-timeout", str(BODY_TIMEOUT), "--max-batch", "1")
    yield s
    s.client.close()
    s.stop()
    log = "".join(s.lines)
    assert s.proc.returncode == 0 and "Traceback" not in log and "ClientDisconnect" not in log, log


def connect(server) -> socket.socket:
    host, port = server.url.split("//")[1].rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=30)
    return s


def read_response(s: socket.socket) -> tuple[int, dict, bytes]:
    """Status, headers and whatever body arrives until the server closes the connection (or 30 s pass)."""
    data = b""
    while True:
        try:
            part = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not part:
            break
        data += part
        if b"\r\n\r\n" in data:
            head, _, body = data.partition(b"\r\n\r\n")
            headers = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:])
            n = int(headers.get("content-length", -1))
            if 0 <= n <= len(body):
                break
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def closed_by_server(s: socket.socket, within: float = 10.0) -> bool:
    s.settimeout(within)
    try:
        while s.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def test_content_length_over_the_limit_is_refused_before_the_body_is_read(edge_server):
    with connect(edge_server) as s:
        t0 = time.monotonic()
        s.sendall(HEAD + b"Content-Length: 20000000\r\n\r\n" + b"x" * 1000)  # 20 MB announced, 1 kB sent
        status, headers, body = read_response(s)
        assert status == 413 and time.monotonic() - t0 < 10
        err = json.loads(body)["error"]
        assert err["code"] == "request_too_large" and "20000000" in err["message"] and str(MAX_BODY) in err["message"]
        assert headers.get("connection") == "close" and closed_by_server(s)


def test_chunked_body_is_counted_and_cut_at_the_limit(edge_server):
    """A chunked body of 64 kB chunks: the 413 comes once the count passes MAX_BODY, long before the 20 MB the client
    would send (it stops at the answer)."""
    with connect(edge_server) as s:
        s.sendall(HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (65536, b"[" * 65536)
        sent, status = 0, None
        s.settimeout(0.05)
        while sent < 20_000_000:
            try:
                s.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError, socket.timeout):
                break
            sent += 65536
            try:
                if s.recv(1, socket.MSG_PEEK):
                    break
            except socket.timeout:
                pass
        s.settimeout(30)
        status, headers, body = read_response(s)
        assert status == 413, (status, body)
        assert sent <= MAX_BODY + 4 * 2**20, f"the server read {sent} bytes before answering"
        assert json.loads(body)["error"]["code"] == "request_too_large"


def test_a_body_a_little_over_the_limit_is_read_and_then_refused(edge_server):
    """Content-Length 2 MiB (over MAX_BODY, under serve.DRAIN_MAX), sent in pieces as a slow client does, the answer
    read only once all is sent (as HTTP clients do): the server drains the body and then answers 413. Answering at
    once and closing would reset the connection under the client's next piece (closing with unread data sends RST),
    and the client would see "connection reset" instead of the 413."""
    body = b'{"prompt": "' + b"x" * (2 << 20) + b'"}'
    with connect(edge_server) as s:
        s.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % len(body))
        step = len(body) // 8 + 1
        for at in range(0, len(body), step):
            time.sleep(0.1)
            s.sendall(body[at:at + step])
        status, headers, answer = read_response(s)
        assert status == 413 and json.loads(answer)["error"]["code"] == "request_too_large"



@pytest.mark.parametrize("announced,drained", [(DRAIN_MAX, True), (DRAIN_MAX + 1, False)])
def test_drain_max_is_the_last_announced_size_that_is_read_first(edge_server, announced, drained):
    """At DRAIN_MAX the server waits for the body (here: 1 kB of it, then nothing) and answers 413 when the body
    timeout ends the wait, not 408; one byte more is refused at once, before the timeout."""
    with connect(edge_server) as s:
        t0 = time.monotonic()
        s.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % announced + b"x" * 1000)
        status, headers, body = read_response(s)
        dt = time.monotonic() - t0
        assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large", (status, body)
        assert str(announced) in json.loads(body)["error"]["message"]
        if drained:
            assert BODY_TIMEOUT * 0.9 <= dt < BODY_TIMEOUT + 10, dt
        else:
            assert dt < BODY_TIMEOUT * 0.9, dt

def test_a_body_that_never_arrives_times_out(edge_server):
    with connect(edge_server) as s:
        t0 = time.monotonic()
        s.sendall(HEAD + b"Content-Length: 100\r\n\r\n{\"prompt\"")  # headers, 9 of 100 bytes, then nothing
        status, headers, body = read_response(s)
        dt = time.monotonic() - t0
        assert status == 408 and BODY_TIMEOUT * 0.9 <= dt < BODY_TIMEOUT + 10, (status, dt)
        err = json.loads(body)["error"]
        assert err["code"] == "request_timeout" and f"{BODY_TIMEOUT:g} s" in err["message"]
        assert closed_by_server(s)


def test_client_leaving_mid_body_is_quiet_and_deep_json_is_refused(edge_server):
    with connect(edge_server) as s:
        s.sendall(HEAD + b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        time.sleep(0.2)
    deep = b'{"prompt": ' + b"[" * (MAX_DEPTH + 1) + b"1" + b"]" * (MAX_DEPTH + 1) + b"}"
    r = edge_server.client.post("/v1/completions", content=deep, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and f"{MAX_DEPTH + 2} deep" in r.json()["error"]["message"], r.text
    r = edge_server.client.post("/v1/completions", content=b"[" * 200_000)  # would be a RecursionError in json
    assert r.status_code == 400 and "deep" in r.json()["error"]["message"]
    assert edge_server.post(prompt="[[[not nesting]]]", max_tokens=2).status_code == 200  # brackets in strings
    time.sleep(0.3)
    log = "".join(edge_server.lines)
    assert "Traceback" not in log and "ClientDisconnect" not in log and "Exception" not in log, log


def test_json_depth_ignores_brackets_in_strings():
    assert json_depth(b'{"a": [[1], {"b": "]]]]"}]}') == 3
    assert json_depth(b'"[[[\\"[["') == 0
    assert json_depth(b"") == 0


def signal_during_a_stream(s, sig):
    """A long stream is running and a second request waits behind it (max batch 1); the signal ends the stream with
    a server_shutdown error event, answers the waiting request 503, and the process exits 0 without a traceback."""
    with connect(s) as a, connect(s) as b:
        body = json.dumps(dict(prompt="A long story", max_tokens=LONG, stream=True)).encode()
        a.sendall(HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        a.settimeout(60)
        first = a.recv(65536)
        assert b" 200 " in first.split(b"\r\n")[0], first
        body2 = json.dumps(dict(prompt="waiting", max_tokens=3)).encode()
        b.sendall(HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(body2), body2))
        deadline = time.monotonic() + 30
        while s.health()["waiting"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        s.proc.send_signal(sig)
        rest = first
        while True:
            part = a.recv(65536)
            if not part:
                break
            rest += part
        status_b, _, body_b = read_response(b)
    assert s.proc.wait(30) == 0
    text = rest.decode(errors="replace")
    assert '"code": "server_shutdown"' in text, text[-2000:]
    assert status_b == 503 and json.loads(body_b)["error"]["code"] == "server_shutdown"
    log = "".join(s.lines)
    assert "Traceback" not in log and "Error" not in log, log


def test_sigint_during_a_stream_ends_it_and_exits_0(model_file):  # noqa: F811
    s = Server(model_file, "--max-batch", "1")
    try:
        signal_during_a_stream(s, signal.SIGINT)
    finally:
        s.client.close()
        s.stop()


def test_sigterm_during_a_stream_ends_it_and_exits_0(edge_server):
    """The last test of the module: it stops the module's server (the fixture then checks its exit and output)."""
    signal_during_a_stream(edge_server, signal.SIGTERM)

