#!/usr/bin/env bash
# Builds the environment of `make vllm-omni-check`: a virtual environment with vLLM's CPU build
# and vllm-omni (requirements-vllm-omni.txt, every package pinned, installed with --no-deps so
# nothing else is pulled in), the environment's workarounds for PyPI's CUDA-only torchvision
# and torchaudio (torch_ext_shim.py, as site-packages/dattn_torch_ext_shim.py + a .pth line),
# and dattn's wheel.
#
#   integrations/vllm-omni/setup_env.sh VENV WHEEL
#
# torch==2.13.0+cpu comes from pip's configured sources: these machines hold the wheel on disk;
# elsewhere set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu (PyTorch's CPU index,
# which also has CPU builds of torchvision and torchaudio; the shim then does nothing).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$(realpath -m "$1")"
wheel="$(realpath "$2")"
python="${VENV_PYTHON:-python3.11}"
requirements="$here/../../requirements-vllm-omni.txt"
start=$SECONDS

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --no-deps -r "$requirements"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cp "$here/torch_ext_shim.py" "$site/dattn_torch_ext_shim.py"
echo "import dattn_torch_ext_shim" > "$site/dattn_torch_ext_shim.pth"
"$venv/bin/python" -m pip install -q --no-deps --force-reinstall "$wheel"
# What the environment must import: the engine, its CPU platform (dattn's), and the packages
# the shim lets import.
(cd / && "$venv/bin/python" - <<'PY'
import torch, torchvision.transforms.functional, torchaudio.functional  # noqa: F401
import vllm, vllm_omni, dattn
from vllm_omni.platforms import current_omni_platform
print("vllm-omni environment: torch", torch.__version__, "vllm", vllm.__version__,
      "platform", type(current_omni_platform).__name__, "dattn", dattn.__file__)
PY
)
echo "vllm-omni environment: $venv built in $((SECONDS - start)) s ($(du -sh "$venv" | cut -f1))"
