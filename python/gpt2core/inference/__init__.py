"""Serving what a model writes: the generate and chat command lines (generate_cli, chat_cli), the continuous-batching
scheduler (scheduler), the OpenAI-compatible server (serve) and the streaming clients that time it (stream_clients).

`gpt2core.inference` was the KV-cache engine's module before the package was grouped by job; its public names are
still here (the engine itself is gpt2core.model.engine, which GPT2.generate uses)."""
from ..model.engine import (EOT, SEED_MAX, ForwardEngine, KVCacheFull, KVEngine, SlotPool, Stream,  # noqa: F401
                            as_prompts, check_stop, generate, generate_stream, model_lock, sample_distribution,
                            sample_reference, truncate_at_stop, uniform)
