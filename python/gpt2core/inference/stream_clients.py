"""Clients that measure an OpenAI-compatible server's streamed completions (gpt2core-serve; llama-server too): one
streamed request, and a burst of them released at one moment, each on a thread and a connection of its own. The
lease driver's serve step and scripts/bench_serve.py both time the server with these."""
from __future__ import annotations

import json
import threading
import time


def stream_one(client, url: str, body: dict, out: dict) -> None:
    """One streamed completion through an httpx.Client made beforehand (its set-up is not timed): out["ttft"] (s to
    the first chunk with text), out["tokens"], out["end"]."""
    t0 = time.monotonic()
    chunks, usage = 0, None
    with client.stream("POST", url + "/v1/completions", json=dict(body, stream=True,
                                                                   stream_options={"include_usage": True})) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"].get("completion_tokens")
            for ch in ev.get("choices") or []:
                if ch.get("text"):
                    out.setdefault("ttft", time.monotonic() - t0)
                    chunks += 1
    out["end"] = time.monotonic()
    out["tokens"] = usage if usage is not None else chunks  # llama-server streams one token per chunk


def stream_burst(url: str, bodies: list[dict], delays: list[float] | None = None) -> tuple[list[dict], float]:
    """Each body (a /v1/completions request; stream_one adds the streaming fields) sent by a thread of its own, all
    released at the same moment, body i delays[i] seconds later: per request out["start"] and stream_one's fields;
    the burst's wall time from the release to the last response's end. RuntimeError (from this thread) when any
    request failed."""
    import httpx
    outs = [{} for _ in bodies]
    delays = delays or [0.0] * len(bodies)
    clients = [httpx.Client(timeout=600) for _ in bodies]
    ready = threading.Barrier(len(bodies) + 1)

    def go(i):
        ready.wait()
        time.sleep(delays[i])
        outs[i]["start"] = time.monotonic()
        try:
            stream_one(clients[i], url, bodies[i], outs[i])
        except Exception as e:  # noqa: BLE001 - reported below, from the caller's thread
            outs[i]["error"] = f"{type(e).__name__}: {e}"

    ts = [threading.Thread(target=go, args=(i,)) for i in range(len(bodies))]
    for t in ts:
        t.start()
    ready.wait()
    t0 = time.monotonic()
    for t in ts:
        t.join()
    wall = time.monotonic() - t0
    for c in clients:
        c.close()
    failed = [o["error"] for o in outs if "error" in o]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(outs)} streamed requests failed: {failed[0]}")
    return outs, wall
