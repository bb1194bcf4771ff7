#!/usr/bin/env bash
# benchmarks/gpu.py on the GPU machine this project is lent now and then (the `device` tool: one
# H100/H200, an image with its own torch, no network), in two steps:
#
#   bash benchmarks/gpu_device.sh prepare          # here, once per session: fills .kit/
#   device run: command "bash benchmarks/gpu_device.sh run --quick", carry [".kit"], timeout_s 560
#
# prepare: the wheels of the packages autopipe imports that the image lacks or may hold too old
# (black with its pytokens, platformdirs and pathspec; pymetis), for the image's Python (3.12), and this checkout's
# torch.distributed.pipelining (pure Python), into .kit/ (ignored by git through
# .git/info/exclude; carried to the machine by the call), read off the project's .venv (or
# $PYTHON).
# run: installs the wheels into /tmp/site, lays the carried pipelining over the image's torch
# where that torch is another version (2.11's refuses the integer labels a stage passes on), and
# runs benchmarks/gpu.py with the arguments given; its figures (gpu.json, calibrated.json,
# parity.json) and its log (kit.log) land in $OUT, which the call brings back.
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=.kit
PYTHON_VERSION=3.12 # the image's python3

case "${1:-}" in
prepare)
    # the project's environment: its torch's pipelining, its black and pymetis versions
    PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
    exclude=$(git rev-parse --git-path info/exclude) # a worktree's too
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.kit/' "$exclude" 2>/dev/null || echo '/.kit/' >>"$exclude"
    rm -rf "$KIT"
    mkdir -p "$KIT/wheels"
    versions=$("$PYTHON" - <<'EOF'
from importlib.metadata import version
print(" ".join(f"{name}=={version(name)}" for name in ("black", "pytokens", "platformdirs", "pathspec", "pymetis")))
EOF
)
    # shellcheck disable=SC2086 # one argument per requirement
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$KIT/wheels" $versions
    pipelining=$("$PYTHON" -c 'import os, torch.distributed.pipelining as p; print(os.path.dirname(p.__file__))')
    cp -r "$pipelining" "$KIT/pipelining"
    "$PYTHON" -c 'import torch; print(torch.__version__)' >"$KIT/pipelining/TORCH_VERSION"
    echo "prepared $KIT: $(ls "$KIT/wheels" | tr '\n' ' ')and torch $(cat "$KIT/pipelining/TORCH_VERSION")'s pipelining ($(du -sh "$KIT" | cut -f1))"
    ;;
run)
    shift
    if [ ! -d "$KIT/wheels" ]; then
        echo "gpu_device.sh run: no $KIT/wheels here; run 'bash benchmarks/gpu_device.sh prepare' first and carry .kit" >&2
        exit 2
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$KIT"/wheels/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    torch_version=$(python3 -c 'import torch; print(torch.__version__)')
    carried=$(cat "$KIT/pipelining/TORCH_VERSION")
    if [ "${torch_version%%+*}" != "${carried%%+*}" ]; then
        torch_dir=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')
        cp -r "$KIT/pipelining/." "$torch_dir/distributed/pipelining/"
        echo "torch $torch_version here: torch.distributed.pipelining of $carried laid over it"
    fi
    export PYTHONUNBUFFERED=1
    out=${OUT:-.}
    python3 benchmarks/gpu.py --json "$out/gpu.json" "$@" 2>&1 | tee "$out/kit.log"
    ;;
*)
    echo "usage: bash benchmarks/gpu_device.sh prepare | run [benchmarks/gpu.py's arguments]" >&2
    exit 2
    ;;
esac
