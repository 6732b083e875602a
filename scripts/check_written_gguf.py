"""Reads the GGUF files `tandem convert` writes with llama.cpp's own Python reader (the `gguf`
package, PyPI) and holds them to the golden fixture's GGUF file, which that package wrote as
llama.cpp's converter lays Qwen3.5 out (scripts/gguf_fixtures.py):

- every tensor of the fixture, under the same name and shape, and no other;
- every `qwen35.*` metadata key of the fixture (those llama.cpp's loader reads) with the same
  value and type;
- bf16: every tensor's bits the fixture's (ssm_a, −exp(A_log), within two float steps: numpy's
  f32 exp wrote the fixture's);
- --quant q8_0, q4_k, q5_k, q6_k: each matrix in the type tandem says it writes (the LM head of
  q4_k and q5_k in Q6_K, rows not of whole 256-value blocks in Q8_0, the embedding as stored),
  and its values as the
  package's own dequantizer reads them within the format's error of the fixture's values
  (relative RMS error per tensor, bounds below).

    python3 -m venv /tmp/gguf-env && /tmp/gguf-env/bin/pip install gguf==0.19.0 numpy
    cargo build --release
    /tmp/gguf-env/bin/python scripts/check_written_gguf.py target/release/tandem

Prints one line per file and exits non-zero on the first difference.
"""
import os
import subprocess
import sys
import tempfile

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(here)
tandem = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "target/release/tandem")
fixture = os.path.join(root, "tests/fixtures/gguf/qwen35-tiny-bf16.gguf")
checkpoint = os.path.join(root, "tests/fixtures/qwen35-tiny")
# Largest relative RMS error of a tensor's values against bf16's, per block type. On the golden
# checkpoint's weights tandem's blocks measure 0.071 (Q4_K), 0.035 (Q5_K), 0.017 (Q6_K) and
# 0.006 (Q8_0); a layout read differently from how it was written gives errors near 1.
BOUND = {Q.Q8_0: 0.01, Q.Q6_K: 0.04, Q.Q5_K: 0.08, Q.Q4_K: 0.15}


def fail(what):
    sys.exit(f"FAIL {what}")


def values(t):
    """A tensor's values as the package reads them, f32, in the file's shape order reversed
    (numpy's row-major)."""
    if t.tensor_type in (Q.F32, Q.F16):
        return np.asarray(t.data, dtype=np.float32)
    if t.tensor_type == Q.BF16:
        return (np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return dequantize(t.data, t.tensor_type)


def field(r, key):
    f = r.fields[key]
    return [f.contents()] if not isinstance(f.contents(), list) else f.contents()


def expected_type(quant, name, t):
    """The type tandem says it writes for tensor `name` (fixture tensor t) under `quant`."""
    if t.tensor_type != Q.BF16 or name == "token_embd.weight":
        return t.tensor_type  # norms, decay, conv: f32 as stored; the embedding as stored
    k = int(t.shape[0])  # a row's values (GGUF lists the fastest dimension first)
    want = {"q8_0": Q.Q8_0, "q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}[quant]
    if quant in ("q4_k", "q5_k") and name == "output.weight":
        want = Q.Q6_K
    if want != Q.Q8_0 and k % 256:
        want = Q.Q8_0
    if k % 32:
        return Q.BF16
    return want


def check(path, quant, ref):
    r = GGUFReader(path)
    names = {t.name: t for t in r.tensors}
    want = {t.name: t for t in ref.tensors}
    if set(names) != set(want):
        fail(f"{path}: tensors {sorted(set(names) ^ set(want))[:6]} in one file and not the other")
    for key in ref.fields:
        # (The golden checkpoint has no tokenizer files, chat template or end-of-sequence id:
        # the fixture took those from elsewhere, so only the architecture's keys compare.)
        if not (key.startswith("qwen35.") or key == "general.architecture"):
            continue
        if key not in r.fields:
            fail(f"{path}: no metadata key {key}")
        if field(r, key) != field(ref, key) or r.fields[key].types != ref.fields[key].types:
            fail(f"{path}: {key} is {str(field(r, key))[:60]}, the fixture's {str(field(ref, key))[:60]}")
    worst = {}
    for name, t in want.items():
        got = names[name]
        if list(got.shape) != list(t.shape):
            fail(f"{path}: {name} of shape {list(got.shape)}, the fixture's {list(t.shape)}")
        a, b = values(got).reshape(-1), values(t).reshape(-1)
        if name.endswith("ssm_a"):
            # −exp(A_log): tandem writes it correctly rounded; numpy's f32 exp, which wrote the
            # fixture, is up to 2 float steps off it (measured on the golden checkpoint).
            ulps = float(np.max(np.abs(a - b) / np.spacing(np.abs(b)))) if a.size else 0.0
            if got.tensor_type != t.tensor_type or ulps > 2:
                fail(f"{path}: {name} ({got.tensor_type.name}) {ulps:.0f} ulps from the fixture's values")
            continue
        if quant is None:
            if got.tensor_type != t.tensor_type or not np.array_equal(a.view(np.uint32), b.view(np.uint32)):
                fail(f"{path}: {name} ({got.tensor_type.name}) differs from the fixture's bits")
            continue
        if got.tensor_type != expected_type(quant, name, t):
            fail(f"{path}: {name} is {got.tensor_type.name}, expected {expected_type(quant, name, t).name}")
        if got.tensor_type in BOUND:
            err = float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b**2)), 1e-30))
            if err > BOUND[got.tensor_type]:
                fail(f"{path}: {name} ({got.tensor_type.name}) at relative RMS error {err:.3g} of the fixture's values (bound {BOUND[got.tensor_type]})")
            worst[got.tensor_type.name] = max(worst.get(got.tensor_type.name, 0.0), err)
        elif not np.array_equal(a, b):
            fail(f"{path}: {name} ({got.tensor_type.name}) differs from the fixture's values")
    detail = ", ".join(f"{k} worst relative RMS error {v:.3g}" for k, v in sorted(worst.items()))
    print(f"ok   {os.path.basename(path)}: {len(names)} tensors and the architecture's metadata as the fixture's" + (f"; {detail}" if detail else ", bit for bit"))


ref = GGUFReader(fixture)
with tempfile.TemporaryDirectory() as d:
    for quant in [None, "q8_0", "q4_k", "q5_k", "q6_k"]:
        out = os.path.join(d, f"tiny-{quant or 'bf16'}.gguf")
        cmd = [tandem, "convert", "--model", checkpoint, "--out", out] + (["--quant", quant] if quant else [])
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            fail(f"{' '.join(cmd)}: {done.stderr.strip()}")
        check(out, quant, ref)
