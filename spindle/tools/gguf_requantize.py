"""A GGUF file re-quantized: its metadata, and each matrix dequantized and quantized
again to a chosen type (gguf-py's writer and quantizers). What the per-type accuracy
benchmark (benchmarks/gguf_agreement.py) and the GGUF tests build their files with."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

QuantizeFn = Callable[[object, object], object]  # (float32 array, type) -> packed blocks


def requantize(src: str | Path, dst: str | Path, types: dict[str, str],
               num_layers: int | None = None, quantize: QuantizeFn | None = None,
               reader=None) -> None:
    """src's metadata and its first num_layers layers (None: all) as a new GGUF file,
    each matrix quantized to the type its name's first matching key in types says
    (1-D tensors stay float32). quantize(data, type) makes the blocks (default
    gguf.quants.quantize, which knows the simple types: Q4_0 ... Q8_0, F16, BF16).
    reader: a gguf.GGUFReader of src already open (reading a file's metadata decodes
    every vocabulary entry one by one: seconds for a real tokenizer), else one is made."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    if quantize is None:
        from gguf.quants import quantize
    reader = reader if reader is not None else GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture",
                                                           "general.file_type"):
            continue
        value = field.contents()
        if field.name == f"{arch}.block_count" and num_layers is not None:
            value = num_layers
        kind = field.types[0]
        writer.add_key_value(field.name, value, kind,
                             sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        if num_layers is not None and tensor.name.startswith("blk.") \
                and int(tensor.name.split(".")[1]) >= num_layers:
            continue
        data = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if data.ndim == 1:
            writer.add_tensor(tensor.name, data)
            continue
        qtype = getattr(GGMLQuantizationType,
                        next(t for key, t in types.items() if key in tensor.name))
        writer.add_tensor(tensor.name, quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
