"""GPT2's text generation: sampling through the KV-cache engine (engine.py), chat replies, the decode weights'
type and the cache's memory bound. A mixin of GPT2, as Hugging Face's GenerationMixin is of its models."""
from __future__ import annotations

from .. import cli


class Generation:
    """GPT2's generation methods (they use the model's lock, config, core `_m`, training and device)."""

    @property
    def kv_cache_limit(self) -> int | None:
        """Bytes the KV cache (keys and values of every live stream and generate call) may grow to; None (default):
        90% of the memory free when it grows (CPU), what the GPU can allocate (CUDA). Beyond it a new stream raises
        inference.KVCacheFull naming the live streams: close() the ones no longer read."""
        from . import engine
        return engine.SlotPool.of(self).limit

    @kv_cache_limit.setter
    def kv_cache_limit(self, nbytes: int | None) -> None:
        from . import engine
        engine.SlotPool.of(self).limit = None if nbytes is None else cli.Int(0).check(nbytes, "kv_cache_limit")

    def generate(self, idx, max_new_tokens: int, top_k: int | None = 50, temperature: float = 1.0, seed=0,
                 top_p: float | None = None, stop=None, stream: bool = False):
        """Sample continuations of prompts through the KV-cache inference path (gpt2core.inference).

        idx: int ids (T,) or (B, T), or a list of prompts of different lengths (lists of ids). Each sequence
        stops after max_new_tokens, at <|endoftext|> (50256) or the chat format's <|assistant_end|> (50260) when the
        vocabulary has them, or once its generated
        text contains one of `stop` (a string or a list; the ids up to the token completing it are kept).
        Sampling: logits / temperature (> 0), the top_k most likely (0 or None: all; 1: greedy), then the
        smallest set whose probability reaches top_p (None: off). Seeded: the same seed gives the same ids.
        max_new_tokens, top_k, temperature, top_p and seed may also be one value per prompt.

        Returns (B, T + max_new_tokens) int32 ids for an array idx (a sequence that stopped early is padded with
        <|endoftext|>), a list of 1-D arrays (prompt + generated) for a list of prompts; with stream=True an
        inference.Stream, an iterator that yields, per step, the (B,) ids just made (-1 for a sequence that had
        already stopped); it owns its KV-cache slots until it ends, close() or garbage collection, so live streams
        and other calls on the model do not disturb each other (see `lock`; inference.KVCacheFull beyond
        kv_cache_limit)."""
        from . import engine
        return engine.generate(self, idx, max_new_tokens, top_k=top_k, temperature=temperature, seed=seed,
                                  top_p=top_p, stop=stop, stream=stream)

    def chat(self, messages, max_new_tokens: int = 256, top_k: int | None = 50, temperature: float = 1.0,
             top_p: float | None = None, seed: int = 0, stream: bool = False):
        """The assistant's reply to a conversation (OpenAI's messages: [{"role": "system" | "user" | "assistant",
        "content": str}, ...]), rendered by gpt2core.chat and generated up to the model's <|assistant_end|> (at most
        max_new_tokens, and no further than the context holds). Sampling as generate. Returns the reply's text, or
        with stream=True an iterator of its pieces as they are made. The model must have been fine-tuned on the chat
        format (gpt2core-train --sft): a vocabulary without the chat tokens is refused (ArgError)."""
        from .. import chat
        return chat.generate_reply(self, messages, max_new_tokens, top_k=top_k, temperature=temperature,
                                   top_p=top_p, seed=seed, stream=stream)

    @property
    def inference_weights(self) -> str:
        """The weights decode reads: "fp32", or "bf16" / "fp16" (16-bit copies widened to fp32 in registers: half
        the bytes per token), or "int8" (8-bit: each matrix row in blocks of 32 inputs with one fp32 scale per
        block, max|w| / 127, the int8 values rounded to nearest; dequantised in registers: 1.125 bytes per weight);
        CPU, inference-only models. Setting "bf16", "fp16" or "int8" rounds the model's matrices (wte, qkvw,
        attprojw, fcw, fcprojw, an untied lm_head) to that type in self.params too, so prefill and decode agree."""
        return ("fp32", "bf16", "fp16", "int8")[self._m.weights16]

    @inference_weights.setter
    def inference_weights(self, kind: str) -> None:
        kinds = {"fp32": 0, "bf16": 1, "fp16": 2, "int8": 3}
        if kind not in kinds:
            raise ValueError(f"inference_weights must be 'fp32', 'bf16', 'fp16' or 'int8', got {kind!r}")
        if kind != "fp32" and (self.training or self.device != "cpu"):
            raise ValueError(f"inference_weights={kind!r} needs an inference-only CPU model (load_model(path, "
                             "training=False) or GPT2(..., training=False)): it rounds the weights")
        with self.lock:
            self._m.weights16 = kinds[kind]

    def _inference_engine(self, batch: int, max_len: int):
        """The engine generate runs on: the core's KV cache where the backend has it, else the full forward."""
        from . import engine
        if hasattr(self._m, "kv_prefill") and self._m.kv_supported:
            return engine.KVEngine(self, batch, max_len)
        return engine.ForwardEngine(self, batch, max_len)
