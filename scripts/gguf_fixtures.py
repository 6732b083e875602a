#!/usr/bin/env python3
"""Writes the GGUF test files under tests/fixtures/gguf/ with the `gguf` Python package (PyPI,
the llama.cpp project's own reader and writer), so that tandem's reader is tested on files
that tool wrote, and its dequantizers against that package's.

    python3 -m venv /tmp/gguf-env && /tmp/gguf-env/bin/pip install gguf==0.19.0 numpy
    /tmp/gguf-env/bin/python scripts/gguf_fixtures.py

blocks.gguf: metadata of every value type (the values are listed in
crates/tandem-core/src/model/gguf/tests.rs), and for each block type tandem reads a 2 x 512
tensor of random blocks (their f16 scales set to finite values) named by the type, with
"<type>.expected": the package's dequantization of it, as F32.
"""
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "gguf"

# Byte offsets of each block type's f16 scales (set to finite values; random bytes would
# often make NaN or infinity).
F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}


def blocks_file(path: Path) -> None:
    rng = np.random.default_rng(20261129)
    w = gguf.GGUFWriter(str(path), "tandem-test")
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4000000000)
    w.add_int32("test.i32", -2000000000)
    w.add_uint64("test.u64", 2**63 + 5)
    w.add_int64("test.i64", -(2**62))
    w.add_float32("test.f32", 0.25)
    w.add_float64("test.f64", -1.5e300)
    w.add_bool("test.bool", True)
    w.add_string("test.str", "Grüße, GGUF")
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.strs", ["a", "", "ccc"])
    rows, cols = 2, 512
    for t, fields in F16_FIELDS.items():
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[t]
        n_blocks = rows * cols // block_elems
        raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
        for at in fields:
            scales = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
            raw[:, at:at + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
        raw = raw.reshape(rows, cols // block_elems * block_bytes)
        w.add_tensor(t.name, raw, raw_dtype=t)
        w.add_tensor(t.name + ".expected", dequantize(raw, t).astype(np.float32).reshape(rows, cols))
    for t, values in [(T.F32, rng.standard_normal((rows, cols)).astype(np.float32)),
                      (T.F16, rng.standard_normal((rows, cols)).astype(np.float16))]:
        w.add_tensor(t.name, values)
        w.add_tensor(t.name + ".expected", values.astype(np.float32))
    bf16 = (rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    w.add_tensor("BF16", bf16.view(np.uint8).reshape(rows, cols * 2), raw_dtype=T.BF16)
    w.add_tensor("BF16.expected", (bf16.astype(np.uint32) << 16).view(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    blocks_file(OUT / "blocks.gguf")
    print(f"wrote {OUT / 'blocks.gguf'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
