#!/usr/bin/env python3
"""Compare two reference files item by item (max abs difference), e.g. a freshly generated one
with the golden fixture: `compare_with_fixture.py NEW.safetensors FIXTURE.safetensors`."""
import sys

from safetensors.torch import load_file

a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
for k in sorted(set(a) & set(b)):
    x, y = a[k].double(), b[k].double()
    if x.shape != y.shape:
        print(f"{k}: shape {tuple(x.shape)} vs {tuple(y.shape)}")
        continue
    print(f"{k}: max |diff| {(x - y).abs().max().item():.3e}")
