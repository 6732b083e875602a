#!/usr/bin/env bash
# Seconds from starting `tandem serve` to its first streamed token: starts the server on a
# loopback port with the engine options given, waits for "listening on", sends one streamed
# completion and stops at its first token. Prints one line:
#   listening S  first-token S  kernels compiled: yes|no
#
#   scripts/first-token-time.sh TANDEM MODEL [ENGINE OPTIONS...]
#   scripts/first-token-time.sh target/release/tandem synthetic:qwen3.5-0.8b --prefill cuda:0 --decode cuda:0
#
# The kernel cache is the user's (TANDEM_CACHE_DIR, else ~/.cache/tandem); point
# TANDEM_CACHE_DIR at an empty directory for a cold start.
set -euo pipefail
tandem=$1 model=$2
shift 2
log=$(mktemp)
trap 'kill "$pid" 2>/dev/null || true; rm -f "$log"' EXIT
start=$(date +%s.%N)
"$tandem" serve --model "$model" --host 127.0.0.1 --port 0 "$@" >"$log" 2>&1 &
pid=$!
while ! grep -q "listening on" "$log"; do
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "tandem serve exited before listening:" >&2
        cat "$log" >&2
        exit 1
    fi
    sleep 0.02
done
listening=$(date +%s.%N)
url=$(grep -o "http://[0-9.:]*" "$log" | head -1)
# The first "data:" line that carries text is the first token (grep stops reading there).
grep -m1 -q '"text"' < <(curl -sN "$url/v1/completions" -H 'content-type: application/json' \
    -d '{"prompt":"The capital of France is","max_tokens":4,"stream":true,"temperature":0}')
first=$(date +%s.%N)
kernels=$(grep -q "kernels compiled" "$log" && echo yes || echo no)
awk -v s="$start" -v l="$listening" -v f="$first" -v k="$kernels" 'BEGIN { printf "listening %.2f s  first-token %.2f s  kernels compiled: %s\n", l - s, f - s, k }'
