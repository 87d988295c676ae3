"""One safetensors file written tensor by tensor: the header (every tensor's dtype, shape and byte
range) first, then each tensor's bytes as it arrives, so a writer holds one tensor at a time, not
the file's worth `safetensors.numpy.save_file` needs. The layout is the format's own: an 8-byte
little-endian header length, the JSON header padded with spaces to 8 bytes, the data."""
from __future__ import annotations

import json
import math
import struct

import numpy as np

from .io_bytes import count

# Paddle's dtype names -> safetensors' (bfloat16 arrives from Paddle as uint16 bits)
DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
          "int32": "I32", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}


def nbytes(shape, dtype):
    return math.prod(shape) * _ITEMSIZE[DTYPES[dtype]]


class StreamingFile:
    """`entries`: [(key, shape, Paddle dtype name)] in the order `write` will receive them."""

    def __init__(self, path, entries):
        header, start = {}, 0
        for key, shape, dtype in entries:
            size = nbytes(shape, dtype)
            header[key] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [start, start + size]}
            start += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.expected = [(key, header[key]["data_offsets"][1] - header[key]["data_offsets"][0]) for key, _, _ in entries]
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(text)) + text)

    def write(self, key, array):
        want_key, size = self.expected.pop(0)
        data = np.ascontiguousarray(array)
        if key != want_key or data.nbytes != size:
            raise ValueError(f"safetensors stream: got {key} ({data.nbytes} bytes), the header expects {want_key} "
                             f"({size} bytes)")
        self.file.write(data.tobytes(order="C"))
        count("written", size)
        if not self.expected:
            self.file.close()

    def close(self):
        self.file.close()
