#!/usr/bin/env python3
"""Writes the GGUF test files under tests/fixtures/gguf/ with the `gguf` Python package (PyPI,
the llama.cpp project's own reader and writer), so that tandem's reader is tested on files
that tool wrote, and its dequantizers against that package's.

    python3 -m venv /tmp/gguf-env && /tmp/gguf-env/bin/pip install gguf==0.19.0 numpy
    /tmp/gguf-env/bin/python scripts/gguf_fixtures.py

qwen35-tiny-bf16.gguf, qwen35-tiny-q8_0.gguf: the golden fixture (tests/fixtures/qwen35-tiny) as
llama.cpp's converter writes Qwen3.5, its matrices in BF16 as stored or quantized to Q8_0.

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


def read_safetensors(path: Path) -> dict:
    """name -> (dtype, array) with bf16 kept as its uint16 bits."""
    import json
    import struct
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        a, b = spec["data_offsets"]
        data = raw[8 + n + a:8 + n + b]
        dtype = {"BF16": np.uint16, "F32": np.float32, "F16": np.float16}[spec["dtype"]]
        out[name] = (spec["dtype"], np.frombuffer(data, dtype=dtype).reshape(spec["shape"]))
    return out


def as_f32(dtype: str, a: np.ndarray) -> np.ndarray:
    return (a.astype(np.uint32) << 16).view(np.float32) if dtype == "BF16" else a.astype(np.float32)


def tiled(a: np.ndarray, axis: int, key_heads: int, group: int, unit: int) -> np.ndarray:
    """Value heads grouped by key head -> tiled, along `axis` (what llama.cpp's converter does
    where a DeltaNet layer has more value heads than key heads)."""
    a = np.moveaxis(a, axis, 0)
    rest = a.shape[1:]
    a = a.reshape(key_heads, group, unit, *rest).swapaxes(0, 1).reshape(key_heads * group * unit, *rest)
    return np.moveaxis(a, 0, axis)


def tiny_file(path: Path, matrix_type) -> None:
    """The golden fixture's checkpoint as llama.cpp's converter writes Qwen3.5 (written anew
    here from the format, not with the converter): its names, the norms as 1 + w and A as
    -exp(A_log) in f32, the conv kernel squeezed, value heads tiled, 1-D and conv tensors in
    F32, matrices as stored (BF16) or quantized to `matrix_type`."""
    import json
    src = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "qwen35-tiny"
    cfg = json.loads((src / "config.json").read_text())["text_config"]
    st = read_safetensors(src / "model.safetensors")
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    group, kd = hv // hk, hk * dk
    w = gguf.GGUFWriter(str(path), "qwen35")
    a = "qwen35."
    w.add_uint32(a + "block_count", cfg["num_hidden_layers"])
    w.add_uint32(a + "context_length", cfg["max_position_embeddings"])
    w.add_uint32(a + "embedding_length", cfg["hidden_size"])
    w.add_uint32(a + "feed_forward_length", cfg["intermediate_size"])
    w.add_uint32(a + "attention.head_count", cfg["num_attention_heads"])
    w.add_uint32(a + "attention.head_count_kv", cfg["num_key_value_heads"])
    w.add_uint32(a + "attention.key_length", cfg["head_dim"])
    w.add_uint32(a + "attention.value_length", cfg["head_dim"])
    w.add_float32(a + "attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_float32(a + "rope.freq_base", cfg["rope_parameters"]["rope_theta"])
    w.add_uint32(a + "rope.dimension_count", int(cfg["head_dim"] * cfg["rope_parameters"]["partial_rotary_factor"]))
    w.add_array(a + "rope.dimension_sections", [11, 11, 10, 0])
    w.add_uint32(a + "ssm.conv_kernel", cfg["linear_conv_kernel_dim"])
    w.add_uint32(a + "ssm.state_size", dk)
    w.add_uint32(a + "ssm.group_count", hk)
    w.add_uint32(a + "ssm.time_step_rank", hv)
    w.add_uint32(a + "ssm.inner_size", hv * dv)
    w.add_uint32(a + "full_attention_interval", 4)
    w.add_uint32("tokenizer.ggml.eos_token_id", 7)
    w.add_string("tokenizer.chat_template", "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    names = {
        "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
        "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
        "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
        "linear_attn.in_proj_b.weight": "ssm_beta.weight", "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
        "linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.conv1d.weight": "ssm_conv1d.weight",
        "linear_attn.norm.weight": "ssm_norm.weight", "linear_attn.out_proj.weight": "ssm_out.weight",
    }
    prefix = "model.language_model."
    for name in sorted(st):
        dtype, t = st[name]
        if name.startswith(("model.visual.", "mtp.")):
            continue  # the vision tower goes to a separate file; MTP layers are skipped
        if name == "lm_head.weight":
            out = "output.weight"
        elif name == prefix + "embed_tokens.weight":
            out = "token_embd.weight"
        elif name == prefix + "norm.weight":
            out = "output_norm.weight"
        else:
            layer, field = name[len(prefix) + len("layers."):].split(".", 1)
            out = f"blk.{layer}.{names[field]}"
        f32 = as_f32(dtype, t)
        matrix = t.ndim == 2 and "conv1d" not in name
        if name.endswith("norm.weight") and "linear_attn.norm" not in name:
            f32 = f32 + np.float32(1)
        if name.endswith("A_log"):
            f32 = -np.exp(f32)
        if "conv1d" in name:
            f32 = f32.squeeze()
        if hv != hk and "linear_attn." in name:
            rows = None
            if "in_proj_qkv" in name:
                rows = (2 * kd, dv)
            elif "in_proj_z" in name:
                rows = (0, dv)
            elif "in_proj_b" in name or "in_proj_a" in name or "A_log" in name or "dt_bias" in name:
                rows = (0, 1)
            elif "conv1d" in name:
                rows = (2 * kd, dv)
            if rows is not None:
                start, unit = rows
                f32 = np.concatenate([f32[:start], tiled(f32[start:], 0, hk, group, unit)])
                t = np.concatenate([t[:start], tiled(t[start:], 0, hk, group, unit)]) if t.ndim == 2 and matrix else t
            elif "out_proj" in name:
                f32 = tiled(f32, 1, hk, group, dv)
                t = tiled(t, 1, hk, group, dv)
        if not matrix:
            w.add_tensor(out, np.ascontiguousarray(f32, dtype=np.float32))
        elif matrix_type == T.BF16:
            w.add_tensor(out, np.ascontiguousarray(t).view(np.uint8), raw_dtype=T.BF16)
        else:
            w.add_tensor(out, gguf.quants.quantize(np.ascontiguousarray(f32), matrix_type), raw_dtype=matrix_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    blocks_file(OUT / "blocks.gguf")
    tiny_file(OUT / "qwen35-tiny-bf16.gguf", T.BF16)
    tiny_file(OUT / "qwen35-tiny-q8_0.gguf", T.Q8_0)
    for f in sorted(OUT.glob("*.gguf")):
        print(f"wrote {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
