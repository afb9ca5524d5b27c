"""gpt2core-serve's GET /metrics (--metrics): requests by status, tokens, the scheduler's queues and slots, time to
first token and inter-token latency, in Prometheus' text format."""
from __future__ import annotations

from ..errors import Error


class Metrics:
    """GET /metrics (--metrics) in Prometheus' text format through prometheus-client, in a registry of this app's
    own: counts and timings only, never a prompt's or a completion's text."""

    def __init__(self, sched, engine_slots: int):
        try:
            import prometheus_client as pc
        except ImportError:  # pragma: no cover - the [serve] extra is missing
            raise Error("--metrics needs prometheus-client: pip install 'gpt2core[serve]'") from None
        self.pc = pc
        self.registry = r = pc.CollectorRegistry()
        self.requests = pc.Counter("gpt2core_requests", "Completion requests answered, by HTTP status",
                                   ["status"], registry=r)
        self.prompt = pc.Counter("gpt2core_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generated = pc.Counter("gpt2core_generation_tokens", "Tokens generated", registry=r)
        pc.Gauge("gpt2core_sequences_running", "Sequences in KV-cache slots", registry=r).set_function(
            sched.running)
        pc.Gauge("gpt2core_requests_waiting", "Requests queued for a slot", registry=r).set_function(sched.waiting)
        pc.Gauge("gpt2core_sequences_waiting", "Their sequences (one per prompt)", registry=r).set_function(
            sched.waiting_sequences)
        pc.Gauge("gpt2core_slots_used", "KV-cache slots in use", registry=r).set_function(sched.slots_used)
        pc.Gauge("gpt2core_slots", "KV-cache slots (--max-batch)", registry=r).set(engine_slots)
        self.ttft = pc.Histogram("gpt2core_time_to_first_token_seconds", "From a request's arrival to its first "
                                 "token", registry=r, buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.itl = pc.Histogram("gpt2core_inter_token_latency_seconds", "Between a sequence's successive tokens",
                                registry=r, buckets=(.005, .01, .02, .04, .08, .16, .32, .64, 1.28, 2.56))

    def observe_ttft(self, s: float) -> None:
        self.ttft.observe(s)

    def observe_itl(self, s: float) -> None:
        self.itl.observe(s)

    def generated_tokens(self, n: int) -> None:
        self.generated.inc(n)

    def prompt_tokens(self, n: int) -> None:
        self.prompt.inc(n)

    def answered(self, status: int) -> None:
        self.requests.labels(str(status)).inc()

    def render(self) -> bytes:
        return self.pc.generate_latest(self.registry)
