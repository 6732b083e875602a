"""A Qwen3.5 checkpoint directory of the 0.8B's published shapes (1.5 GB of bf16 values in a
repeating pattern, tied embedding): for timing what loading a real checkpoint costs without
downloading one. The text is noise.

    python3 scripts/write_shaped_checkpoint.py OUT_DIR [TEMPLATE_CONFIG]

TEMPLATE_CONFIG (default: the golden fixture's config.json) gives every config field the shapes
do not set. Standard library only.
"""
import array
import json
import os
import struct
import sys

out = sys.argv[1]
template = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(__file__), "../tests/fixtures/qwen35-tiny/config.json")
h, layers, heads, kvh, hv, f, V = 1024, 24, 8, 2, 16, 3584, 248320
hk, dk, dv, hd = 16, 128, 128, 256
kd, vd = hk * dk, hv * dv
cd = 2 * kd + vd
P = "model.language_model."
t = [(P + "embed_tokens.weight", [V, h]), (P + "norm.weight", [h])]
for i in range(layers):
    p = f"{P}layers.{i}."
    t += [(p + "input_layernorm.weight", [h]), (p + "post_attention_layernorm.weight", [h]),
          (p + "mlp.gate_proj.weight", [f, h]), (p + "mlp.up_proj.weight", [f, h]), (p + "mlp.down_proj.weight", [h, f])]
    if (i + 1) % 4:
        a = p + "linear_attn."
        t += [(a + "A_log", [hv]), (a + "conv1d.weight", [cd, 1, 4]), (a + "dt_bias", [hv]), (a + "in_proj_a.weight", [hv, h]),
              (a + "in_proj_b.weight", [hv, h]), (a + "in_proj_qkv.weight", [cd, h]), (a + "in_proj_z.weight", [vd, h]),
              (a + "norm.weight", [dv]), (a + "out_proj.weight", [h, vd])]
    else:
        a = p + "self_attn."
        t += [(a + "q_proj.weight", [2 * heads * hd, h]), (a + "k_proj.weight", [kvh * hd, h]), (a + "v_proj.weight", [kvh * hd, h]),
              (a + "o_proj.weight", [h, heads * hd]), (a + "q_norm.weight", [hd]), (a + "k_norm.weight", [hd])]
header, off = {"__metadata__": {"format": "pt"}}, 0
for name, shape in t:
    n = 2
    for s in shape:
        n *= s
    header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [off, off + n]}
    off += n
hj = json.dumps(header).encode()
hj += b" " * (-len(hj) % 8)
# The bf16 bits of 0.01 * (i % 13 - 6), repeated.
vals = [struct.unpack("<I", struct.pack("<f", 0.01 * (i % 13 - 6)))[0] >> 16 for i in range(13 * 4096)]
block = array.array("H", vals).tobytes()
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "model.safetensors"), "wb") as fo:
    fo.write(struct.pack("<Q", len(hj))); fo.write(hj)
    left = off
    while left:
        k = min(left, len(block)); fo.write(block[:k]); left -= k
cfg = json.load(open(template))
tc = cfg["text_config"]
tc.update(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kvh, head_dim=hd,
          intermediate_size=f, vocab_size=V, linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dk,
          linear_value_head_dim=dv, tie_word_embeddings=True, max_position_embeddings=262144,
          layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)])
cfg["tie_word_embeddings"] = True
json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=2)
print(f"{out}: {off / 1e9:.2f} GB of weights")
