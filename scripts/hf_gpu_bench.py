#!/usr/bin/env python3
"""Hugging Face transformers on the same GPU and the same synthetic shapes as
`tandem bench --sections cuda`: Qwen3.5 text models with random bf16 weights (the shapes of
tandem's synthetic:qwen3.5-0.8b and -9b, from crates/tandem-core/src/config.rs `preset`),
prefill of a P-token prompt and greedy decode of N tokens through the cache, one sequence.

    python3 scripts/hf_gpu_bench.py [--models 0.8b,9b] [--prompt 2048] [--decode 64] [--reps 5]

Prints one Markdown row per model (median of the repetitions after a warm-up). Needs torch with
CUDA and transformers >= 5 (Qwen3.5 support).
"""
import argparse
import statistics
import time

import torch

PRESETS = {
    # hidden, layers, heads, kv heads, linear value heads, ffn, tied
    "0.8b": (1024, 24, 8, 2, 16, 3584, True),
    "2b": (2048, 24, 8, 2, 16, 6144, True),
    "9b": (4096, 32, 16, 4, 32, 12288, False),
}


def build(name):
    import transformers
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    hidden, layers, heads, kv, lin_v, ffn, tied = PRESETS[name]
    cfg = Qwen3_5TextConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=ffn,
        vocab_size=248320,
        rms_norm_eps=1e-6,
        max_position_embeddings=262144,
        tie_word_embeddings=tied,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=256,
        rope_theta=1e7,
        partial_rotary_factor=0.25,
        linear_num_key_heads=16,
        linear_num_value_heads=lin_v,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16)
    model.eval()
    return model, transformers.__version__


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


@torch.no_grad()
def bench(name, prompt, decode, reps):
    model, version = build(name)
    ids = (torch.arange(prompt, device="cuda") * 7919 + 13) % 248044
    ids = ids.unsqueeze(0)
    prefill = []
    for r in range(reps + 1):
        dt, _ = timed(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1))
        if r > 0:
            prefill.append(dt)
    # Decode: a 13-token prompt, then one token at a time through the cache.
    out = model(input_ids=ids[:, :13], use_cache=True, logits_to_keep=1)
    cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    steps = []
    for _ in range(decode):
        dt, out = timed(lambda: model(input_ids=nxt, past_key_values=cache, use_cache=True))
        cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        steps.append(dt)
    p = statistics.median(prefill)
    s = statistics.median(steps[2:]) if len(steps) > 4 else statistics.median(steps)
    fast = "fast path kernels" if _has_fla() else "torch fallback for the DeltaNet (flash-linear-attention not installed)"
    print(f"| transformers {version} ({fast}) | qwen3.5-{name} | {prompt / p:.0f} | {1 / s:.1f} |", flush=True)
    del model, cache
    torch.cuda.empty_cache()


def _has_fla():
    try:
        import fla  # noqa: F401

        return True
    except ImportError:
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="0.8b,9b")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(f"\nPrefill of {a.prompt} tokens, decode of {a.decode} steps after a 13-token prompt (median)\n")
    print("| engine | model | prefill tok/s | decode tok/s |\n|---|---|---|---|")
    for m in a.models.split(","):
        try:
            bench(m.strip(), a.prompt, a.decode, a.reps)
        except Exception as e:  # report and go on to the next model
            print(f"| transformers | qwen3.5-{m} | failed: {type(e).__name__}: {e} | |", flush=True)


if __name__ == "__main__":
    main()
