# cuBLAS through PyTorch on the projection shapes of the synthetic Qwen3.5-0.8B, at a decode
# step of 256 sequences (M = 256) and a packed prefill of 16 prompts of 512 tokens (M = 8192):
# microseconds a product (20 calls captured in a CUDA graph, median of 5 replays), TFLOP/s and
# GB/s, with cuBLAS and with cuBLASLt preferred; for M = 256 also K split in 2 and 4 (a batched
# product of the pieces, their sum left out: what a split-K could at best gain).
# `python3 scripts/cublas_shapes.py` on a machine with a CUDA GPU and PyTorch.
import torch

torch.manual_seed(0)


def timeit(fn, reps=20, rounds=5):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    out = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / reps)
    out.sort()
    return out[len(out) // 2]


# (N, K): DeltaNet in (qkv, z, b, a), attention in (q + gate, k, v), attention / DeltaNet out,
# MLP gate + up, MLP down, LM head.
shapes = [(8224, 1024), (5120, 1024), (1024, 2048), (7168, 1024), (1024, 3584), (248320, 1024)]
for lib in ["cublas", "cublaslt"]:
    torch.backends.cuda.preferred_blas_library(lib)
    for m in [256, 8192]:
        for n, k in shapes:
            if m == 8192 and n == 248320:
                continue
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            o = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            us = timeit(lambda: torch.mm(x, w.t(), out=o))
            line = f"{lib} M={m} K={k} N={n}: {us:.1f} us {2 * m * n * k / us / 1e6:.0f} TFLOP/s {(n * k * 2 + m * k * 2 + m * n * 2) / us / 1e3:.0f} GB/s"
            if lib == "cublas":
                for s in [2, 4]:
                    xs = x.view(m, s, k // s).transpose(0, 1)
                    ws = w.view(n, s, k // s).permute(1, 2, 0)
                    us2 = timeit(lambda: torch.bmm(xs, ws))
                    line += f" | bmm split {s}: {us2:.1f} us"
            print(line, flush=True)
