#!/usr/bin/env bash
# Checks that every crate of the workspace packages for crates.io: moe-codegen, moe-runtime,
# moe-checkpoint, moe-dsl, the moeforge facade and the moe-jit CLI (publish order: that one,
# each depending only on those before).
#
# `cargo package --workspace` packages them all and verifies each one by building it alone from
# its .crate. The crates depend on each other at version 0.1.0, which crates.io does not hold
# before they are published in order; cargo (1.90+) resolves those dependencies against a local
# registry of the .crate files it has just made (target/package/tmp-registry), so even the
# dependent crates are verified here. On an older cargo, pass `--no-verify`: dependent crates
# cannot be verified against crates.io before their dependencies are published there. (Nor, with
# some cargo versions, once crates.io already holds this very version: bump it after a release.)
#
# --allow-dirty: packages the working tree as it is (uncommitted edits included), as CI and
# `scripts/test.sh` check it. Extra arguments go to `cargo package` (e.g. `--no-verify`).
# Then: moe-codegen's package must hold askama.toml and every template (the derive reads them at
# build time), and each .crate must stay under crates.io's 10 MiB limit; their sizes are listed.
set -euo pipefail
cd "$(dirname "$0")/.."

# Cargo unpacks the local registry's crates under ~/.cargo/registry/src/<its hash>/ and reuses
# an unpacked NAME-VERSION it finds there, so a verify after the crates changed (same version)
# would build the stale copies: remove those of a local registry (its directory name starts
# with '-'), never crates.io's.
# Its builds of them are reused the same way (a registry crate's build is keyed by name and
# version): package and verify in a target dir of their own, emptied first.
rm -rf "${CARGO_HOME:-$HOME/.cargo}"/registry/src/-*/{moe-codegen,moe-runtime,moe-checkpoint,moe-dsl,moe-jit,moeforge}-[0-9]*
export CARGO_TARGET_DIR="$PWD/target/package-check"
rm -rf "$CARGO_TARGET_DIR"
cargo package --workspace --allow-dirty "$@"

fail=0
list=$(cargo package --list -p moe-codegen --allow-dirty 2>/dev/null)
for f in askama.toml $(cd moe-codegen && ls templates/*); do
  if ! grep -qxF "$f" <<<"$list"; then
    echo "moe-codegen's package lacks $f" >&2
    fail=1
  fi
done

echo "== packages ($(ls moe-codegen/templates | wc -l) templates in moe-codegen's)"
cargo metadata --no-deps --format-version 1 | python3 -c '
import json, os, sys
m = json.load(sys.stdin)
bad = 0
for p in sorted(m["packages"], key=lambda p: p["name"]):
    path = os.path.join(m["target_directory"], "package", "%s-%s.crate" % (p["name"], p["version"]))
    size = os.path.getsize(path)
    print("%-12s %-8s %8.1f KiB  %s" % (p["name"], p["version"], size / 1024, os.path.relpath(path)))
    if size > 10 * 1024 * 1024:
        print("  over crates.io'"'"'s 10 MiB limit", file=sys.stderr)
        bad = 1
sys.exit(bad)' || fail=1

exit $fail
