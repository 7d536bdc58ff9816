"""The greedy sampler's Triton argmax (runner/sample/argmax_kernel.py) against torch's
argmax, id for id, on fresh random logits: vocabularies around the chunk size, maxima
tied within a chunk and across chunks, rows of -inf, NaN and +inf. On a GPU in float32,
bf16 and fp16; under Triton's interpreter (no GPU) in float32 and fp16."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, HALF, INTERPRETED, KernelStub

pytestmark = [pytest.mark.gpu, pytest.mark.kernel]

DTYPES = [torch.float32, HALF] + ([] if INTERPRETED else [torch.float16])


def _chunk() -> int:
    from spindle.runner.sample.argmax_kernel import CHUNK

    return CHUNK


def _check(logits: torch.Tensor) -> None:
    from spindle.runner.sample.argmax_kernel import argmax_rows

    got = argmax_rows(logits)
    assert got.dtype == torch.int64 and got.shape == (logits.shape[0],)
    assert got.tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab_at", [(1, (3, 5)), (3, (1, -1)), (2, (1, 0)),
                                           (5, (1, 1)), (1, (0, 100)), (4, (75, 37))])
def test_random_rows(rows, vocab_at, dtype):
    """vocab = chunks x CHUNK + extra ids (75 x 2,048 + 37: a 152k vocabulary, on a GPU)."""
    chunks, extra = vocab_at
    if INTERPRETED and chunks > 5:
        chunks = 5
    vocab = chunks * _chunk() + extra
    generator = torch.Generator().manual_seed(rows * 1000 + vocab)
    _check(torch.randn(rows, vocab, generator=generator).to(dtype).to(DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_go_to_the_first_id(dtype):
    """Equal maxima in one chunk, in two chunks (the later chunk's id smaller within its
    chunk), and a row where every id ties."""
    chunk = _chunk()
    vocab = 3 * chunk + 11
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3)).to(dtype)
    logits[0, [40, 9, 700]] = 30.0
    logits[1, [chunk + 900, 2 * chunk + 5, 3 * chunk + 10]] = 30.0
    logits[2] = 1.5
    logits[3, [vocab - 1, vocab - 2]] = 30.0
    _check(logits.to(DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
def test_infinities_and_nan(dtype):
    """A row of -inf takes id 0; +inf beats every finite value; a NaN beats +inf, the
    first NaN of the row winning, whichever chunk it is in."""
    chunk = _chunk()
    vocab = 2 * chunk + 3
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(4)).to(dtype)
    logits[0] = float("-inf")
    logits[1, [chunk + 2, 7]] = float("inf")
    logits[2, 3] = float("inf")
    logits[2, [chunk + 1, 2 * chunk + 2]] = float("nan")
    logits[3, [20, 10]] = float("nan")
    logits[4, :] = float("-inf")
    logits[4, vocab - 1] = -1e4
    _check(logits.to(DEVICE))


def test_strided_rows_and_errors():
    """Rows of a wider buffer (a padded head's logits cut to the vocabulary) and an
    empty batch; logits that are not [rows, vocab] with unit-strided rows are refused."""
    from spindle.runner.sample.argmax_kernel import argmax_rows

    wide = torch.randn(3, _chunk() + 64, generator=torch.Generator().manual_seed(5))
    _check(wide.to(DEVICE)[:, :_chunk() + 7])
    assert argmax_rows(torch.zeros(0, 10, device=DEVICE)).shape == (0,)
    with pytest.raises(ValueError, match=r"\[rows, vocab\]"):
        argmax_rows(torch.zeros(10, device=DEVICE))
    with pytest.raises(ValueError, match="unit-strided"):
        argmax_rows(torch.zeros(10, 4, device=DEVICE).t())


def test_also_into_receives_the_same_ids():
    """also_into (a decode graph's input ids) gets each row's id as the output does, and
    nothing past its rows; one that is not a contiguous int64 [rows] on the logits'
    device is refused."""
    from spindle.runner.sample.argmax_kernel import argmax_rows

    logits = torch.randn(3, 2 * _chunk() + 5, generator=torch.Generator().manual_seed(6))
    logits = logits.to(DEVICE)
    inputs = torch.full((5,), -7, dtype=torch.int64, device=DEVICE)
    got = argmax_rows(logits, also_into=inputs[:3])
    assert got.tolist() == logits.argmax(dim=-1).tolist()
    assert inputs.tolist() == got.tolist() + [-7, -7]
    for bad in (inputs[:2], inputs[:3].to(torch.int32),
                torch.zeros(6, dtype=torch.int64, device=DEVICE)[::2]):
        with pytest.raises(ValueError, match="also_into must be a contiguous int64"):
            argmax_rows(logits, also_into=bad)


@pytest.mark.skipif(INTERPRETED, reason="compiling ahead skips compiled launches on a GPU")
def test_a_skipped_first_kernel_leaves_id_zero_while_compiling_ahead():
    """Inside warm-up's compile-ahead pass a launch that would compile is skipped. When
    the chunk kernel is new (bf16 logits, a vocabulary not a multiple of 16) but the row
    kernel is compiled (the same number of chunks, float32 logits earlier in the
    process), the row kernel runs on the chunks' scratch: it must give id 0, not an id
    from unwritten memory (a bf16 Whisper start after a float32 engine read such an id
    as its warm-up token and failed on a device-side assert)."""
    from spindle.runner import compile_ahead
    from spindle.runner.sample.argmax_kernel import argmax_rows

    chunks = 37  # (a chunk count no other test here uses)
    generator = torch.Generator().manual_seed(9)
    _check(torch.randn(3, chunks * _chunk(), generator=generator).to(DEVICE))
    logits = torch.randn(3, chunks * _chunk() - 3, generator=generator).to(HALF).to(DEVICE)
    # Freed blocks of the scratch tensors' size, full of ids past any vocabulary, for
    # the caching allocator to hand out again.
    junk = [torch.full((128,), 1 << 30, dtype=torch.int32, device=DEVICE) for _ in range(64)]
    del junk
    with compile_ahead.compiling_ahead(torch.device(DEVICE), threads=2):
        ids = argmax_rows(logits)
    assert ids.tolist() == [0, 0, 0]
    _check(logits)  # (compiled on leaving: the real ids now)


def test_the_row_kernel_after_a_skipped_chunk_kernel_gives_id_zero(monkeypatch):
    """The same case wherever the kernels run: the chunk kernel's launch skipped (as
    compile_ahead.py's hook skips it) and the scratch tensors' memory unwritten (here:
    full of ids past the vocabulary); the row kernel that runs after it must give 0."""
    from spindle.runner.sample import argmax_kernel

    class UnwrittenMemory:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*shape, dtype, device):
            return torch.full(*shape, 1 << 30, dtype=dtype, device=device)

    logits = torch.randn(3, 2 * _chunk() + 5, generator=torch.Generator().manual_seed(4))
    monkeypatch.setattr(argmax_kernel, "_chunk_argmax_kernel", KernelStub())
    monkeypatch.setattr(argmax_kernel, "torch", UnwrittenMemory())
    assert argmax_kernel.argmax_rows(logits.to(DEVICE)).tolist() == [0, 0, 0]
