"""GPT2's files: llm.c model files and Hugging Face directories (gpt2core.formats: llmc, pretrained). A mixin of
GPT2; load_model (gpt2.py) reads any of them."""
from __future__ import annotations

from ..formats import llmc, pretrained


class Files:
    """Reading and writing a GPT2's weights."""

    @classmethod
    def from_pretrained(cls, path, device: str = "cpu", padded_vocab_size: int | None = None,
                        training: bool = True):
        """Load a Hugging Face GPT-2 directory (config.json + model.safetensors or pytorch_model.bin), a
        Hub name such as "gpt2" (needs huggingface_hub and network), an llm.c model file (v3/v5) or a
        gpt2core checkpoint directory (weights only). padded_vocab_size: for HF models (default: vocab
        rounded up to 128). Problems raise CheckpointError naming the file. training=False: inference-only (see
        __init__)."""
        config, flat, source = pretrained.read_weights(path, padded_vocab_size)
        model = cls(config, device=device, init=False, training=training)
        llmc.fill_params(model, flat, source)
        return model

    def save_pretrained(self, path):
        """Write a Hugging Face GPT-2 directory (config.json + model.safetensors) that transformers'
        GPT2LMHeadModel.from_pretrained loads; the padded vocab rows are dropped. A model with the modern
        architecture is refused (ValueError naming the fields GPT-2's format cannot represent)."""
        return pretrained.save_pretrained(self, path)

    def save(self, path, dtype: str = "float32", format: str = "auto"):
        """Write an llm.c model file: dtype "float32" (version 3) or "bfloat16" (version 5). A model with the
        modern architecture is written in gpt2core's extension of the format (versions 1003 / 1005: the full
        config in the header; load_model reads it, llm.c refuses it); format="llmc" demands llm.c's own format and
        refuses such a model, naming the fields llm.c cannot represent."""
        return llmc.save_model(self, path, dtype=dtype, format=format)
