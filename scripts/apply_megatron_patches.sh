#!/usr/bin/env bash
# Apply megatron_bytescale's hooks to a Megatron-LM checkout at a supported tag.
#
#   bash scripts/apply_megatron_patches.sh /path/to/Megatron-LM
#
# The patch is picked by the checkout's version (megatron/core/package_info.py):
#   0.16.1  (tag core_v0.16.1)  -> patches/megatron-lm-core_v0.16.1.patch   (Python 3.10-3.11)
#   0.19.x  (tag core_v0.19.0)  -> patches/megatron-lm-core_v0.19.0.patch   (Python 3.12+)
# Any other version is refused with that list. Then it dry-runs the patch (`git apply --check`)
# and applies it. Exits 0 without changes when the patch is already applied. See
# patches/README.md for what each hunk does.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SUPPORTED="0.16.1 (Megatron-LM tag core_v0.16.1), 0.19.x (Megatron-LM tag core_v0.19.0)"

die() { echo "error: $*" >&2; exit 1; }

[[ $# -eq 1 ]] || die "usage: bash scripts/apply_megatron_patches.sh /path/to/Megatron-LM"
command -v git >/dev/null || die "git is needed (the patch is applied with 'git apply')"
MLM="$(cd "$1" 2>/dev/null && pwd)" || die "no such directory: $1"
[[ -f "$MLM/pretrain_gpt.py" && -f "$MLM/megatron/training/training.py" ]] \
    || die "$MLM does not look like a Megatron-LM checkout (no pretrain_gpt.py or megatron/training/training.py)"

# --- version: megatron/core/package_info.py picks the patch -------------------------------
INFO="$MLM/megatron/core/package_info.py"
[[ -f "$INFO" ]] || die "$INFO is missing; is this a Megatron-LM checkout?"
found="$(sed -n 's/^MAJOR = \([0-9]*\)$/\1/p; s/^MINOR = \([0-9]*\)$/\1/p; s/^PATCH = \([0-9]*\)$/\1/p' "$INFO" | paste -sd. -)"
case "$found" in
    0.16.1) TAG="core_v0.16.1" ;;
    0.19.*) TAG="core_v0.19.0" ;;  # the tag's package_info reads 0.19.1; any 0.19.x takes it
    *) die "$MLM is Megatron-LM ${found:-of unknown version}; megatron_bytescale supports $SUPPORTED.
       Check out a supported tag first, e.g.:  git -C $MLM fetch --tags && git -C $MLM checkout core_v0.19.0" ;;
esac
PATCH="$HERE/patches/megatron-lm-${TAG}.patch"
[[ -f "$PATCH" ]] || die "patch file not found: $PATCH"
if git -C "$MLM" rev-parse --git-dir >/dev/null 2>&1; then
    if git -C "$MLM" rev-parse -q --verify "refs/tags/$TAG" >/dev/null; then
        if git -C "$MLM" merge-base --is-ancestor "$TAG" HEAD; then
            ahead="$(git -C "$MLM" rev-list --count "$TAG..HEAD")"
            [[ "$ahead" == 0 ]] && echo "Megatron-LM checkout: $MLM at $TAG" \
                || echo "Megatron-LM checkout: $MLM, $ahead commit(s) on top of $TAG"
        else
            die "HEAD of $MLM is not $TAG nor based on it (package_info says $found, but the tag
       is not an ancestor). Check out the tag:  git -C $MLM checkout $TAG"
        fi
    else
        echo "Megatron-LM checkout: $MLM (package_info $found; tag $TAG not in this clone, not checked)"
    fi
else
    echo "Megatron-LM source tree: $MLM (package_info $found; not a git checkout)"
fi
echo "Patch for Megatron-LM $found: $(basename "$PATCH")"

# --- already applied? ------------------------------------------------------------------------
cd "$MLM"
if git apply --reverse --check "$PATCH" >/dev/null 2>&1; then
    echo "The ByteScale patch is already applied to $MLM; nothing to do."
    exit 0
fi

# --- dry run, then apply ---------------------------------------------------------------------
FILES=(pretrain_gpt.py megatron/training/arguments.py megatron/training/training.py)
if ! check_output="$(git apply --check "$PATCH" 2>&1)"; then
    echo "error: the patch does not apply cleanly to $MLM:" >&2
    echo "$check_output" | sed 's/^/    /' >&2
    if git rev-parse --git-dir >/dev/null 2>&1; then
        changed="$(git status --short -- "${FILES[@]}")"
        if [[ -n "$changed" ]]; then
            echo "These files it patches have local changes:" >&2
            echo "$changed" | sed 's/^/    /' >&2
            echo "Commit or stash them (git stash), or apply by hand using patches/README.md." >&2
        fi
    fi
    exit 1
fi
git apply "$PATCH"
echo "Applied $(basename "$PATCH") to:"
printf '    %s\n' "${FILES[@]}"
cat <<EOF

Next steps:
  1. Install the plugin where Megatron-LM runs:   pip install -e $HERE
  2. Train with HDP: add the --bytescale-* flags to pretrain_gpt.py, e.g. with the example
     launcher (edit its paths and sizes first):
         MEGATRON_LM_DIR=$MLM bash $HERE/scripts/pretrain_gpt_bytescale.sh
  Flags, what is supported and how HDP replaces context parallelism: $HERE/docs/megatron_lm.md
  Without --bytescale-hdp the patched Megatron-LM behaves exactly as before.
  To undo:  cd $MLM && git apply --reverse $PATCH
EOF
