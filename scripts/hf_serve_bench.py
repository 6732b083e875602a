#!/usr/bin/env python3
"""The peer of `tandem bench --sections serve`: the same workload through Hugging Face
transformers on the same GPU. C requests of I random prompt tokens and O output tokens
(min_new_tokens = max_new_tokens, as ignore_eos), greedy, as one padded batch through
`model.generate` (the prompts have one length, so nothing is padded); output tok/s is C * O over
the wall time of the whole call, prefill included (one warm-up call of 4 tokens first).
Transformers' continuous batching (`generate_batch`) is tried after, timed the same way where
it runs (no warm-up), its refusal reported where not.

    python3 scripts/hf_serve_bench.py [--models 0.8b,9b] [--input-len 512] [--output-len 128]
                                      [--concurrency 1,8,32,64,128,256] [--reps 1]

Prints one Markdown row per (model, concurrency): the median of the repetitions after a
warm-up. The models are the synthetic shapes of hf_gpu_bench.py (random bf16 weights).
"""
import argparse
import statistics

import torch

from hf_gpu_bench import build, timed


def continuous_batching(model, prompts, output_len):
    """Seconds for `generate_batch` over `prompts`, or what it raised (one line)."""
    try:
        from transformers import GenerationConfig

        cfg = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
        dt, _ = timed(lambda: model.generate_batch(inputs=[p.tolist() for p in prompts], generation_config=cfg))
        return dt
    except Exception as e:  # report whatever it raised, in one line
        return f"{type(e).__name__}: {e}".splitlines()[0][:200]


@torch.no_grad()
def run(name, input_len, output_len, concurrency, reps):
    model, version = build(name)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    batches = {c: torch.randint(0, 248044, (c, input_len), device="cuda", generator=gen) for c in concurrency}
    for c, prompts in batches.items():
        mask = torch.ones_like(prompts)
        call = lambda n: model.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        call(4)  # warm-up
        times = []
        for _ in range(reps):
            dt, out = timed(lambda: call(output_len))
            assert out.shape == (c, input_len + output_len), out.shape
            times.append(dt)
        t = statistics.median(times)
        mem = torch.cuda.max_memory_allocated() / 2**30
        rows.append(f"| {name} | transformers {version} `generate` (padded batch) | {c} | {c * output_len / t:,.0f} | {t:.2f} | {mem:.1f} |")
        torch.cuda.reset_peak_memory_stats()
    # Continuous batching last: it switches the model to paged attention for good.
    refusal = None
    for c, prompts in batches.items():
        got = continuous_batching(model, prompts, output_len)
        if isinstance(got, str):
            refusal = got
            break
        rows.append(f"| {name} | transformers {version} `generate_batch` (continuous batching) | {c} | {c * output_len / got:,.0f} | {got:.2f} | {torch.cuda.max_memory_allocated() / 2**30:.1f} |")
    del model
    torch.cuda.empty_cache()
    return rows, refusal or "ran"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="0.8b,9b")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", default="1,8,32,64,128,256")
    ap.add_argument("--reps", type=int, default=1)
    a = ap.parse_args()
    concurrency = [int(c) for c in a.concurrency.split(",")]
    print(f"GPU: {torch.cuda.get_device_name()}; {a.input_len} random prompt tokens, {a.output_len} output tokens, greedy; median of {a.reps} after a warm-up\n")
    print("| model | engine | concurrency | output tok/s | wall s | peak memory GiB |\n|---|---|---|---|---|---|")
    notes = []
    for name in a.models.split(","):
        rows, refusal = run(name, a.input_len, a.output_len, concurrency, a.reps)
        print("\n".join(rows), flush=True)
        notes.append(f"{name}: continuous batching (generate_batch): {refusal}")
    print("\n" + "\n".join(notes))


if __name__ == "__main__":
    main()
