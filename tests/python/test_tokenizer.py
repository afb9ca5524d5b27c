"""GPT-2 BPE through tiktoken from the vocabulary shipped in the package, checked against the
published and generated vectors in shared/data/gpt2/tokenizer_test_vectors.json."""
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from gpt2core import tokenizer

VECTORS = Path(__file__).resolve().parents[3] / "shared" / "data" / "gpt2" / "tokenizer_test_vectors.json"
SHARED_VOCAB = VECTORS.parent


@pytest.fixture(scope="module")
def vectors():
    if not VECTORS.exists():
        pytest.skip(f"{VECTORS} not present")
    return json.loads(VECTORS.read_text())


def test_every_vector_encodes_and_decodes(vectors):
    assert len(vectors["cases"]) >= 40
    for case in vectors["cases"]:
        got = tokenizer.encode(case["text"], allow_special=case["allow_special"])
        assert got == case["tokens"], case["text"]
        assert tokenizer.decode(got) == case["text"]


def test_endoftext_is_plain_text_unless_allowed():
    assert tokenizer.encode("<|endoftext|>", allow_special=True) == [tokenizer.EOT]
    plain = tokenizer.encode("<|endoftext|>")
    assert tokenizer.EOT not in plain and len(plain) > 1


def test_tiny_shakespeare_stream_matches_recorded_hash(vectors):
    ref = vectors["tinyshakespeare"]
    toks = np.array(tokenizer.encode((tokenizer.ASSETS / "tinyshakespeare.txt").read_text()), dtype="<u2")
    assert toks.size == ref["n_tokens"] == 338025
    assert toks[:64].tolist() == ref["first_64_tokens"]
    assert toks[-16:].tolist() == ref["last_16_tokens"]
    assert hashlib.sha256(toks.tobytes()).hexdigest() == ref["sha256_of_tokens_as_uint16_le"]


def test_shipped_vocab_is_byte_identical_to_shared_copy():
    for name in ("encoder.json", "vocab.bpe"):
        shipped = (tokenizer.ASSETS / name).read_bytes()
        if (SHARED_VOCAB / name).exists():
            assert shipped == (SHARED_VOCAB / name).read_bytes()
        # the sha256 tiktoken pins for OpenAI's originals
    assert hashlib.sha256((tokenizer.ASSETS / "vocab.bpe").read_bytes()).hexdigest().startswith("1ce1664773c5")
    assert hashlib.sha256((tokenizer.ASSETS / "encoder.json").read_bytes()).hexdigest().startswith("196139668be6")
