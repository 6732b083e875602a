#!/usr/bin/env bash
# The test suite, with the NIXL transfer's tests: installs what the `nixl` feature needs into
# target/tools (scripts/nixl.sh: the NIXL libraries and libclang from PyPI), then runs every
# test of the workspace. Arguments go to cargo test (e.g. `scripts/test.sh --test nixl`).
# Without NIXL, `cargo test --release --workspace` runs all the other tests.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/nixl.sh)"
exec cargo test --release --workspace --features nixl "$@"
