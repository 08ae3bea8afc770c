#!/usr/bin/env bash
# Print a Python >= 3.12 interpreter that actually runs (pyenv shims can exist but fail), or fail loudly.
for c in python3.13 python3.12 python3; do
  if p=$(command -v "$c" 2>/dev/null) && "$p" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
    echo "$p"; exit 0
  fi
done
root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
for p in "$root"/versions/3.1[2-9]*/bin/python3; do
  if [ -x "$p" ] && "$p" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
    echo "$p"; exit 0
  fi
done
echo "error: jds needs Python >= 3.12 (jax 0.11.2); none found on PATH or under pyenv ($root/versions)." >&2
echo "       install one (e.g. 'pyenv install 3.12') and re-run." >&2
exit 1
