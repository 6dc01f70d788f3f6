"""The real vllm-omni engine (vLLM's CPU build and vllm-omni from PyPI, .venv-vllm-omni: make
vllm-omni-check) with dattn's wheel: every engine runs in a process of its own (engine_run.py)
under a time limit, its whole process group killed if it passes it (a hang fails the test).

Outside that environment the suite is skipped, unless DATTN_REQUIRE_ENGINE=1 (set by make
vllm-omni-check), where a missing engine is an error.
"""

import json
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

try:
    import vllm_omni  # noqa: F401
except Exception as e:  # pragma: no cover - the environment decides
    if os.environ.get("DATTN_REQUIRE_ENGINE") == "1":
        raise RuntimeError(f"vllm-omni is not importable in {sys.executable}: {e}") from e
    pytest.skip(f"vllm-omni's engine is not importable here ({e}); make vllm-omni-check runs "
                f"this suite in its environment", allow_module_level=True)

sys.path.insert(0, str(HERE))


def pytest_configure(config):
    # pytest-xdist registers it too; without xdist the mark only groups nothing.
    config.addinivalue_line("markers", "xdist_group(name): run on one pytest-xdist worker")


import pipelines  # noqa: E402
from process_group import run_process  # noqa: E402


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Builds (lazily, once) the tiny pipeline folders: models("wan", "float32") -> path."""
    root = tmp_path_factory.mktemp("models")
    built = {}

    def get(name: str, dtype: str = "bfloat16") -> str:
        key = (name, dtype)
        if key not in built:
            built[key] = pipelines.build(name, str(root / f"{name}-{dtype}"), "tiny", dtype)
        return built[key]

    return get


class EngineRun:
    """One engine process's results: ``outputs`` (numpy arrays per request), ``result``
    (engine_run.py's result.json), ``calls`` (the call log's records), ``log`` (its output),
    ``returncode``."""

    def __init__(self, out: Path, returncode: int, log: str):
        import numpy as np

        self.returncode = returncode
        self.log = log
        result = out / "result.json"
        self.result = json.loads(result.read_text()) if result.exists() else None
        self.outputs = [np.load(p) for p in sorted(out.glob("output_*.npy"),
                                                   key=lambda p: int(p.stem.split("_")[1]))]
        calls = out / "calls.jsonl"
        records = ([json.loads(line) for line in calls.read_text().splitlines()]
                   if calls.exists() else [])
        self.calls = [r for r in records if "platform_fallback" not in r]
        #: Platform attributes the engine asked for that dattn's platform does not define.
        self.platform_fallbacks = sorted({r["platform_fallback"] for r in records
                                          if "platform_fallback" in r})

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.splitlines()[-n:])


@pytest.fixture
def engine(tmp_path):
    """engine(model, requests, backend=..., attention_config=..., dtype=..., ulysses=...,
    ring=..., timeout=..., env=...) -> EngineRun: one engine in a fresh process."""
    count = [0]

    def run(model, requests, *, timeout=240, env=None, **request):
        count[0] += 1
        out = tmp_path / f"engine{count[0]}"
        out.mkdir()
        spec = dict(request, model=model, out=str(out), requests=requests)
        (out / "request.json").write_text(json.dumps(spec))
        environ = dict(os.environ, HF_HUB_OFFLINE="1", DATTN_VLLM_OMNI_CALL_LOG=str(out / "calls.jsonl"))
        environ.pop("DIFFUSION_ATTENTION_BACKEND", None)
        environ.update(env or {})
        try:
            code, log = run_process([sys.executable, str(HERE / "engine_run.py"),
                                     str(out / "request.json")], environ, timeout,
                                    out / "log.txt")
        except TimeoutError as e:
            pytest.fail(str(e))
        return EngineRun(out, code, log)

    return run
