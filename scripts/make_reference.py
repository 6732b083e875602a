#!/usr/bin/env python3
"""Write a reference file for `tandem verify` from any Qwen3.5 checkpoint, with Hugging Face
transformers (the reference implementation) in float32 on the CPU, or in float64 (--dtype
float64: the same formulas with rounding errors 2^29 times smaller, which tells which of two
float32 computations is nearer the exact result; stored as float32).

    python3 scripts/make_reference.py CHECKPOINT_DIR OUT.safetensors [--lengths 1,7,64,100,300]
        [--greedy 16] [--seed 0] [--prompts-from OTHER_REFERENCE.safetensors] [--dtype float64]

For each prompt pK the file holds (the layout of the golden fixtures):
  pK.input_ids [L] i64, pK.prefill_logits [L, vocab] f32,
  pK.state.I.conv [conv_dim, K] / pK.state.I.recurrent [Hv, Dk, Dv] (linear-attention layers),
  pK.state.I.k / pK.state.I.v [Hkv, L, D] (full-attention layers),
  pK.greedy_ids [G] i64 (ids[0] from the prompt's last logits), pK.greedy_logits [G, vocab] f32
  (logits after feeding ids[i]).
Metadata records the conventions `tandem verify` needs:
  linear_state_at = "prompt"  (states are copied right after the prefill)
  rope_inv_freq   = "f32" or "bf16" (whether the model's RoPE frequency buffer is bf16-rounded)
Needs: torch, transformers >= 5 (Qwen3.5 support), safetensors.
"""
import argparse
import sys

import torch
from safetensors.torch import load_file, save_file


def load_model(path, dtype):
    import transformers

    last_error = None
    for cls_name in ("AutoModelForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"):
        cls = getattr(transformers, cls_name, None)
        if cls is None:
            continue
        try:
            model = cls.from_pretrained(path, dtype=dtype, attn_implementation="eager")
            return model.eval()
        except Exception as e:  # noqa: BLE001 - try the next class, report the last failure
            last_error = e
    sys.exit(f"error: transformers could not load {path} as Qwen3.5: {last_error}")


def text_config(model):
    cfg = model.config
    return getattr(cfg, "text_config", None) or cfg


def rope_inv_freq(model):
    for name, buf in model.named_buffers():
        if name.endswith("rotary_emb.inv_freq") and "visual" not in name:
            return buf
    sys.exit("error: no rotary_emb.inv_freq buffer found in the model")


def snapshot_states(cache, tc, length):
    """The cache after the prefill, copied (later decode steps update some tensors in place)."""
    conv_dim = 2 * tc.linear_num_key_heads * tc.linear_key_head_dim + tc.linear_num_value_heads * tc.linear_value_head_dim
    out = {}
    for i, kind in enumerate(tc.layer_types):
        layer = cache.layers[i]
        # transformers 5 keeps LinearAttentionLayer.conv_states / recurrent_states as dicts
        # (one entry per state slot); older versions as tensors.
        tensors = []
        for v in vars(layer).values():
            tensors += [t for t in (v.values() if isinstance(v, dict) else [v]) if torch.is_tensor(t)]
        if kind == "linear_attention":
            conv = [t for t in tensors if t.dim() == 3 and t.shape[1] == conv_dim]
            rec = [t for t in tensors if t.dim() == 4 and t.shape[1] == tc.linear_num_value_heads]
            if len(conv) != 1 or len(rec) != 1:
                sys.exit(f"error: cannot identify layer {i}'s conv/recurrent state among {[tuple(t.shape) for t in tensors]}")
            out[f"state.{i}.conv"] = conv[0][0].detach().float().clone()
            out[f"state.{i}.recurrent"] = rec[0][0].detach().float().clone()
        else:
            k, v = layer.keys, layer.values
            assert k.shape[2] == length, (k.shape, length)
            out[f"state.{i}.k"] = k[0].detach().float().clone()
            out[f"state.{i}.v"] = v[0].detach().float().clone()
    return out


@torch.no_grad()
def run_prompt(model, ids, greedy):
    from transformers import DynamicCache

    tc = text_config(model)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids[None], past_key_values=cache, use_cache=True)
    tensors = {"input_ids": ids.clone(), "prefill_logits": out.logits[0].float().clone()}
    tensors.update(snapshot_states(out.past_key_values, tc, len(ids)))
    next_id = int(out.logits[0, -1].argmax())
    greedy_ids, greedy_logits = [], []
    cache = out.past_key_values
    for _ in range(greedy):
        greedy_ids.append(next_id)
        step = model(input_ids=torch.tensor([[next_id]]), past_key_values=cache, use_cache=True)
        cache = step.past_key_values
        greedy_logits.append(step.logits[0, -1].float().clone())
        next_id = int(step.logits[0, -1].argmax())
    tensors["greedy_ids"] = torch.tensor(greedy_ids, dtype=torch.int64)
    tensors["greedy_logits"] = torch.stack(greedy_logits)
    return tensors


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--lengths", default="1,7,64,100,300", help="prompt lengths (random ids)")
    ap.add_argument("--greedy", type=int, default=16, help="greedy continuation steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts-from", help="take the prompts (pK.input_ids) of another reference file")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="the precision the model computes in")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    model = load_model(args.checkpoint, getattr(torch, args.dtype))
    tc = text_config(model)
    if args.prompts_from:
        src = load_file(args.prompts_from)
        prompts = {k[: -len(".input_ids")]: v for k, v in sorted(src.items()) if k.endswith(".input_ids")}
    else:
        # Real tokens only: Qwen3.5 pads its 248077 ids to 248320 embedding rows.
        high = min(tc.vocab_size, 248077)
        prompts = {f"p{i}": torch.randint(0, high, (int(n),)) for i, n in enumerate(args.lengths.split(","))}

    tensors = {}
    for name, ids in prompts.items():
        print(f"{name}: {len(ids)} tokens", file=sys.stderr)
        for k, v in run_prompt(model, ids.to(torch.int64), args.greedy).items():
            tensors[f"{name}.{k}"] = v.contiguous()
    inv = rope_inv_freq(model)
    rounded = torch.equal(inv.float(), inv.to(torch.bfloat16).float())
    meta = {
        "linear_state_at": "prompt",
        "rope_inv_freq": "bf16" if rounded else "f32",
        "generator": f"scripts/make_reference.py, transformers {__import__('transformers').__version__}, torch {torch.__version__}, {args.dtype}",
    }
    save_file(tensors, args.out, metadata=meta)
    print(f"wrote {args.out}: {len(prompts)} prompts, conventions {meta}", file=sys.stderr)


if __name__ == "__main__":
    main()
