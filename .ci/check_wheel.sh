#!/usr/bin/env bash
# The wheel as a user gets it: the one `make test` built (build/dist; built here if absent)
# installed into a fresh virtual environment (python3.11, only numpy besides, pinned as in
# requirements.txt), imported outside the source tree, one forward, `python -m dattn info`,
# every entry point the package declares resolving, then `pip uninstall`, after which nothing
# of dattn is left in the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
ls build/dist/dattn-*.whl >/dev/null 2>&1 || make wheel
wheel=$(ls "$root"/build/dist/dattn-*.whl)
numpy=$(grep -E '^numpy==' requirements.txt)
env=$(mktemp -d /tmp/dattn-wheel-check.XXXXXX)
trap 'rm -rf "$env"' EXIT
echo "check_wheel: $wheel into a fresh $env (python3.11, $numpy)"
python3.11 -m venv "$env"
"$env/bin/pip" install -q "$numpy" "$wheel"
cd /tmp
"$env/bin/python" - "$env" <<'PY'
import importlib.metadata as md, sys
import numpy as np
import dattn
env = sys.argv[1]
assert dattn.__file__.startswith(env), dattn.__file__
files = sorted(str(f) for f in md.distribution("dattn").files)
assert all(f.startswith(("dattn/", "dattn-")) for f in files), files  # the package only
q = np.random.default_rng(0).standard_normal((1, 16, 2, 32), dtype=np.float32)
out = dattn.Attention(num_heads=2, head_size=32).forward(q, q, q)
assert out.shape == (1, 16, 2, 32) and np.isfinite(out).all()
eps = md.distribution("dattn").entry_points
for ep in eps:
    ep.load()  # raises if the target does not resolve
print(f"check_wheel: imported {dattn.__file__}, one forward, {len(eps)} entry point(s) resolved:",
      ", ".join(f"{ep.group}:{ep.name}" for ep in eps) or "none declared")
PY
"$env/bin/python" -m dattn info --threads 1 | head -2
"$env/bin/pip" uninstall -q -y dattn
if "$env/bin/python" -c "import dattn" 2>/dev/null; then echo "check_wheel: dattn still importable"; exit 1; fi
left=$(find "$env/lib" -iname 'dattn*' | head -5)
[ -z "$left" ] || { echo "check_wheel: left after uninstall: $left"; exit 1; }
echo "check_wheel: uninstalled, nothing left"
