"""scripts/bench.py --generate's glue for the engines beside the core (bench_generate.py, bench_llamacpp.py), where it
runs without torch or llama.cpp: the cache key of converted GGUF files, what is unpacked from llama-cpp-python's
sdist, the Hugging Face export the converter reads, the greedy ids and their comparison, the table, and one small
run of the benchmark. The figures themselves are not checked (speed is measured, never asserted)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpt2core import GPT2
from gpt2core.config import GPT2Config

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import bench_generate as bg  # noqa: E402
import bench_llamacpp as lc  # noqa: E402

CFG = GPT2Config(block_size=23, vocab_size=50257, padded_vocab_size=50304, n_layer=2, n_head=3, n_embd=48)


def small(seed=0):
    return GPT2(CFG, seed=seed, training=False)


def test_model_key_follows_the_weights_and_the_config():
    a, b = small(0), small(0)
    ka = lc.model_key(a.config, a.flat_params())
    assert re.fullmatch(r"[0-9a-f]{16}", ka)
    assert lc.model_key(b.config, b.flat_params()) == ka                # same weights, another model object
    assert lc.model_key(a.config, small(1).flat_params()) != ka         # other weights
    p = a.flat_params().copy()
    p[12345] = np.nextafter(p[12345], np.float32(np.inf))               # one weight, one ulp
    assert lc.model_key(a.config, p) != ka
    other = GPT2Config(block_size=24, vocab_size=50257, padded_vocab_size=50304, n_layer=2, n_head=3, n_embd=48)
    assert lc.model_key(other, a.flat_params()) != ka                   # another field, the same bytes


def test_gguf_files_are_cached_per_model_and_type(tmp_path):
    p = lc.gguf_paths(tmp_path / "gguf-abc-0.3.36")
    assert list(p) == ["f32", "f16", "q8_0"]
    assert p["q8_0"] == tmp_path / "gguf-abc-0.3.36" / "model-q8_0.gguf"
    # converted files already there: no converter runs (a converter that does not exist would fail)
    folder = tmp_path / "gguf-k-v"
    folder.mkdir()
    for t in ("f32", "f16"):
        (folder / f"model-{t}.gguf").write_bytes(b"GGUF")
    got = lc.convert(None, "k", ["f32", "f16"], tmp_path / "no-such-converter.py", "v", root=tmp_path)
    assert got == {"f32": folder / "model-f32.gguf", "f16": folder / "model-f16.gguf"}


def test_only_the_converter_and_what_it_imports_are_unpacked_from_the_sdist():
    base = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
    names = [base + n for n in ("convert_hf_to_gguf.py", "convert_hf_to_gguf_update.py", "conversion/__init__.py",
                                "conversion/gpt2.py", "gguf-py/gguf/__init__.py", "ggml/src/ggml.c", "README.md",
                                "tools/conversion/x.py")] + ["llama_cpp_python-0.3.36/llama_cpp/llama.py"]
    got = [rel for _, rel in lc._sdist_members(names)]
    assert got == ["convert_hf_to_gguf.py", "conversion/__init__.py", "conversion/gpt2.py",
                   "gguf-py/gguf/__init__.py"]


def test_converter_from_a_folder_that_lacks_it_is_named(tmp_path):
    with pytest.raises(RuntimeError, match=re.escape(f"--llama-cpp-dir {tmp_path}: no convert_hf_to_gguf.py")):
        lc.find_converter("0.3.36", tmp_path, root=tmp_path)
    (tmp_path / "convert_hf_to_gguf.py").write_text("")
    assert lc.find_converter("0.3.36", tmp_path, root=tmp_path) == tmp_path / "convert_hf_to_gguf.py"


def test_hf_export_carries_the_gpt2_tokenizer_files(tmp_path):
    pytest.importorskip("safetensors")
    m = small()
    d = lc.export_hf(m, tmp_path / "hf")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "gpt2" and cfg["vocab_size"] == 50257
    vocab = json.loads((d / "vocab.json").read_text())
    assert len(vocab) == 50257 and vocab["<|endoftext|>"] == 50256 and vocab["Ġthe"] == 262
    merges = (d / "merges.txt").read_text().splitlines()
    assert merges[0].startswith("#version") and merges[1] == "Ġ t" and len(merges) == 50001
    back = GPT2.from_pretrained(d, training=False)   # the weights the converter reads are the model's
    np.testing.assert_array_equal(back.flat_params(), m.flat_params())


def test_bench_greedy_ids_are_the_full_forwards_arg_max():
    """time_core's ids (what every engine is compared with) against argmax of the full forward, token by token."""
    m = small(3)
    prompts = bg.make_prompts(CFG.vocab_size, 2, 5)
    assert [p.tolist() for p in prompts] == [p.tolist() for p in bg.make_prompts(CFG.vocab_size, 2, 5)]
    _, _, ids = bg.time_core(m, prompts, 6)
    assert ids.shape == (2, 7)
    for b in range(2):
        x = list(prompts[b])
        for i in range(7):
            _, logits = m.forward(np.array([x], dtype=np.int32), return_logits=True)
            z = logits[0, -1, :CFG.vocab_size].astype(np.float64)
            top2 = np.sort(z)[-2:]
            if top2[1] - top2[0] > 1e-4 * np.abs(z).max():   # not a near-tie: the cached path must pick it
                assert ids[b, i] == int(np.argmax(z)), (b, i)
            x.append(int(ids[b, i]))


def test_tie_gap_reads_our_logits_where_the_ids_part():
    m = small(4)
    prompt = bg.make_prompts(CFG.vocab_size, 1, 4)[0]
    _, _, ids = bg.time_core(m, [prompt], 5)
    ours = ids[0]
    assert bg.tie_gap(m, prompt, ours, ours.copy()) is None
    theirs = ours.copy()
    theirs[3] = (ours[3] + 7) % CFG.vocab_size
    i, gap, zmax = bg.tie_gap(m, prompt, ours, theirs)
    x = np.concatenate([prompt, ours[:3]]).astype(np.int32)[None]
    z = m.forward(x, return_logits=True)[1][0, -1]
    assert i == 3 and gap == pytest.approx(float(z[ours[3]] - z[theirs[3]]), rel=1e-6) and gap > 0
    assert zmax == pytest.approx(float(np.abs(z[:CFG.vocab_size]).max()))
    assert lc.common_prefix([1, 2, 3], [1, 2]) == 2 and lc.common_prefix([5], [6]) == 0


def test_table_rows_line_up_and_ratios_are_ours_over_theirs():
    r = {"weights": "fp32", "prompt": 200, "batch": 1, "new_tokens": 32, "prefill_ms": 100.0, "decode_tok_s": 50.0,
         "of_bound": 0.8, "hf_prefill_ms": 300.0, "hf_decode_tok_s": 20.0, "hf_same": 33,
         "llama_type": "f32", "llama_prefill_ms": 80.0, "llama_decode_tok_s": 62.5, "llama_same": 7}
    for hf in (False, True):
        for llama in (False, True):
            assert len(bg.format_row(r, hf, llama)) == len(bg.format_header(hf, llama))
    line = bg.format_row(r, True, True)
    assert re.search(r"\|\s+300\.0\s+20\.0\s+3\.00x\s+2\.50x\s+33/33\s+\|", line), line
    assert re.search(r"\|\s+F32\s+80\.0\s+62\.5\s+0\.80x\s+0\.80x\s+7/33\s*$", line), line
    b8 = dict(r, batch=8, of_bound=None, llama_decode_tok_s=None)
    line = bg.format_row(b8, True, True)
    assert len(line) == len(bg.format_header(True, True)) and line.rstrip().endswith("-"), line


def test_generate_bench_runs_and_prints_a_row_per_case():
    """The benchmark end to end on the tiny preset (HF / llama.cpp columns too where this Python has them)."""
    p = subprocess.run([sys.executable, str(SCRIPTS / "bench.py"), "--generate", "--preset", "tiny", "--threads", "1",
                        "--prompts", "3", "5", "--batches", "1", "2", "--new-tokens", "4", "--weights", "fp32",
                        "bf16", "--llama-types", "f32", "f16"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = re.findall(r"^\s*(fp32|bf16)\s+(\d+)\s+(\d+) \|\s+([0-9.]+)\s+([0-9.]+)", p.stdout, re.M)
    assert [(w, int(P), int(B)) for w, P, B, *_ in rows] == [
        (w, P, B) for w in ("fp32", "bf16") for P in (3, 5) for B in (1, 2)], p.stdout
    assert all(float(ms) > 0 and float(tps) > 0 for *_, ms, tps in rows), p.stdout
    assert re.search(r"^fp32: batch 2 / batch 1 tokens/s at prompt 5: [0-9.]+x$", p.stdout, re.M), p.stdout
    assert "Hugging Face" in p.stdout and "llama.cpp" in p.stdout   # measured, or why not


@pytest.mark.parametrize("outtype,C", [("f32", 64), ("q8_0", 64), ("q8_0", 48)])
def test_gguf_written_without_torch_holds_the_model_as_llama_cpp_reads_it(tmp_path, outtype, C):
    """bench_llamacpp.write_gguf (llama.cpp's converter needs torch): read back with llama.cpp's own GGUF reader,
    every tensor is the model's under the gpt2 architecture's name and layout (f32 exact, q8_0 within its
    rounding: half a step of each 32-value block's scale), the hyperparameters and the GPT-2 vocabulary with its
    merges are those of the model, and q8_0 keeps what the converter keeps in f32 (positions, norms, biases). C = 48:
    a row of 48 is no multiple of q8_0's 32-value block, and those matrices fall back to f16 as in the converter,
    while the MLP's down projection (rows of 4C = 192) is still q8_0."""
    gguf = pytest.importorskip("gguf")
    cfg = GPT2Config(block_size=32, vocab_size=50257, padded_vocab_size=50304, n_layer=2, n_head=2, n_embd=C)
    m = GPT2(cfg, seed=3, training=False)
    rng = np.random.default_rng(0)
    for k in ("ln1b", "lnfw", "qkvb"):  # not the init's constants: a swapped bias or gain must show
        m.params[k][...] = rng.standard_normal(m.params[k].shape).astype(np.float32)
    m.params_changed()
    path = lc.write_gguf(m, tmp_path / "m.gguf", outtype, Path(gguf.__file__).resolve().parents[1])
    r = gguf.GGUFReader(str(path))
    field = lambda name: r.fields[name].contents()  # noqa: E731
    assert field("general.architecture") == "gpt2"
    assert (field("gpt2.block_count"), field("gpt2.context_length"), field("gpt2.embedding_length"),
            field("gpt2.feed_forward_length"), field("gpt2.attention.head_count")) == (2, 32, C, 4 * C, 2)
    tokens = field("tokenizer.ggml.tokens")
    assert len(tokens) == 50257 and tokens[50256] == "<|endoftext|>" and tokens[198] == "Ċ"  # "\n", byte-level
    merges = field("tokenizer.ggml.merges")
    assert len(merges) == 50000 and merges[0] == "Ġ t"
    assert field("tokenizer.ggml.eos_token_id") == 50256 and field("tokenizer.ggml.model") == "gpt2"
    t = {x.name: x for x in r.tensors}
    assert "output.weight" not in t and len(t) == 2 + 12 * 2 + 2  # the tied head: llama.cpp reuses token_embd

    def read(name):
        x = t[name]
        if x.tensor_type == gguf.GGMLQuantizationType.Q8_0:
            return gguf.quants.dequantize(x.data, x.tensor_type), x
        return np.asarray(x.data, dtype=np.float32), x

    ours = {"token_embd.weight": m.params["wte"][:50257], "position_embd.weight": m.params["wpe"],
            "output_norm.weight": m.params["lnfw"], "output_norm.bias": m.params["lnfb"]}
    names = {"attn_norm.weight": "ln1w", "attn_norm.bias": "ln1b", "attn_qkv.weight": "qkvw",
             "attn_qkv.bias": "qkvb", "attn_output.weight": "attprojw", "attn_output.bias": "attprojb",
             "ffn_norm.weight": "ln2w", "ffn_norm.bias": "ln2b", "ffn_up.weight": "fcw", "ffn_up.bias": "fcb",
             "ffn_down.weight": "fcprojw", "ffn_down.bias": "fcprojb"}
    for i in range(2):
        ours.update({f"blk.{i}.{g}": m.params[o][i] for g, o in names.items()})
    for name, want in ours.items():
        got, x = read(name)
        want = np.asarray(want, dtype=np.float32)
        assert tuple(reversed([int(d) for d in x.shape])) == want.shape, name  # ggml lists ne0 (the row) first
        packed = outtype == "q8_0" and want.ndim == 2 and name != "position_embd.weight"
        quantized = packed and want.shape[1] % 32 == 0
        T = gguf.GGMLQuantizationType
        assert x.tensor_type == (T.Q8_0 if quantized else T.F16 if packed else T.F32), name
        got = got.reshape(want.shape)
        if packed and not quantized:
            np.testing.assert_array_equal(got, want.astype(np.float16).astype(np.float32), err_msg=name)
        elif quantized:
            step = np.abs(want.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
            # half a step, plus the scale stored in fp16 (2**-11 relative) times up to 127 steps
            assert np.all(np.abs(got - want).reshape(-1, 32) <= step * (0.5 + 127 * 2.0**-11) + 1e-12), name
        else:
            np.testing.assert_array_equal(got, want, err_msg=name)
