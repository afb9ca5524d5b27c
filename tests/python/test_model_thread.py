"""gpt2core-serve's model thread (scheduler.ModelThread): the model is loaded, its KV cache reserved and every model
call of the serving loop made in ONE thread, so that GNU OpenMP holds one pool of workers (two pools on a 2-core
machine made every decode step wait for sleeping workers: 2-4x slower, see ModelThread's docstring). Checked here:
the thread's semantics (order, results, exceptions, one thread), and that an app built with a model thread calls the
engine from that thread only, through real requests."""
import threading

import numpy as np
import pytest

from gpt2core import GPT2
from gpt2core.scheduler import ModelThread, SlotEngine
from test_serve import CONFIG


def test_calls_run_in_one_thread_in_order_with_results_and_exceptions():
    mt = ModelThread(name="test-model-thread")
    try:
        seen = []
        futures = [mt.submit(lambda i=i: seen.append((i, threading.get_ident())) or i * i) for i in range(20)]
        assert [f.result(10) for f in futures] == [i * i for i in range(20)]
        assert [i for i, _ in seen] == list(range(20))               # in submission order
        assert len({t for _, t in seen}) == 1 and seen[0][1] != threading.get_ident()
        with pytest.raises(ZeroDivisionError):
            mt.call(lambda: 1 / 0)
        assert mt.call(lambda a, b=0: a + b, 2, b=3) == 5              # still serving after an exception
    finally:
        mt.close()
    for _ in range(100):
        if not mt.is_alive():
            break
        threading.Event().wait(0.05)
    assert not mt.is_alive()


@pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")
def test_the_served_model_is_only_called_from_the_model_thread(monkeypatch):
    """create_app(model_thread=...): SlotEngine is made there and every engine call of the serving loop (prefill,
    decode, sample, logits, free) runs there, while the requests come from the test's thread."""
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient
    from gpt2core.serve import create_app

    calls = []
    for name in ("__init__", "prefill", "decode", "sample", "logits", "free"):
        orig = getattr(SlotEngine, name)

        def spy(self, *a, _orig=orig, _name=name, **kw):
            calls.append((_name, threading.get_ident()))
            return _orig(self, *a, **kw)
        monkeypatch.setattr(SlotEngine, name, spy)
    mt = ModelThread()
    model = mt.call(lambda: GPT2(CONFIG, seed=1, training=False))
    where = mt.call(threading.get_ident)
    try:
        with TestClient(create_app(model, max_batch=2, model_thread=mt)) as client:
            for body in (dict(prompt="The cat", max_tokens=5, temperature=0),
                         dict(prompt=["a b", "c d e"], max_tokens=3, temperature=0.7, seed=4, logprobs=2),
                         dict(prompt="x y z", max_tokens=0, echo=True, logprobs=1)):
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
    finally:
        mt.close()
    names = {n for n, _ in calls}
    assert {"__init__", "prefill", "decode", "sample", "logits", "free"} <= names, names
    assert {t for _, t in calls} == {where}
    assert np.all([t != threading.get_ident() for _, t in calls])
