"""One vllm-omni engine, in this process, on a request file: the real engine as a user runs it
(``vllm_omni.Omni(...).generate(...)``), for tests/vllm_omni and bench/vllm_omni.py.

    python engine_run.py REQUEST.json

REQUEST: {"model": folder, "out": folder, "dtype": "bfloat16" | "float32" (optional),
"backend": a name for DIFFUSION_ATTENTION_BACKEND (optional), "attention_config": the engine's
``diffusion_attention_config`` (optional), "ulysses": N, "ring": N (optional), "requests":
[{"prompt", "height", "width", "steps", "frames" (video), "seed", "guidance"}, ...]}.

Writes OUT/output_<i>.npy (each request's image or video as float32 in [0, 1]) and
OUT/result.json: {"init_seconds", "requests": [{"seconds", "shape", "error"}]}. Exits 0 when
the engine ran every request (an engine error is in result.json, with exit status 3).
"""

import json
import os
import sys
import time


def as_array(x):
    import numpy as np

    try:
        import torch

        if isinstance(x, torch.Tensor):
            x = x.float().cpu().numpy()
    except ImportError:  # pragma: no cover
        pass
    arr = np.asarray(x)
    if arr.dtype == np.uint8:
        arr = arr.astype(np.float32) / 255.0
    return arr.astype(np.float32)


def main(path: str) -> int:
    with open(path) as f:
        req = json.load(f)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if req.get("backend"):
        os.environ["DIFFUSION_ATTENTION_BACKEND"] = req["backend"]
    from vllm_omni import Omni
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    kwargs = {}
    if req.get("dtype"):
        kwargs["dtype"] = req["dtype"]
    if req.get("attention_config"):
        kwargs["diffusion_attention_config"] = req["attention_config"]
    for key, name in (("ulysses", "ulysses_degree"), ("ring", "ring_degree")):
        if int(req.get(key, 1)) > 1:
            kwargs[name] = int(req[key])
    out_dir = req["out"]
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.perf_counter()
    omni = Omni(model=req["model"], **kwargs)
    result = {"init_seconds": time.perf_counter() - t0, "requests": []}
    status = 0
    try:
        for i, r in enumerate(req["requests"]):
            params = OmniDiffusionSamplingParams(height=r.get("height", 64),
                                                 width=r.get("width", 64),
                                                 num_inference_steps=r.get("steps", 2),
                                                 seed=r.get("seed", 0))
            if r.get("frames") is not None:
                params.num_frames = r["frames"]
            if r.get("guidance") is not None:
                params.guidance_scale = r["guidance"]
            t = time.perf_counter()
            outs = omni.generate({"prompt": r.get("prompt", "a red cat"), "negative_prompt": ""},
                                 params)
            seconds = time.perf_counter() - t
            out = outs[0]
            entry = {"seconds": seconds, "error": out.error, "shape": None}
            if out.error is None and out.images:
                arr = as_array(out.images[0])
                import numpy as np

                np.save(os.path.join(out_dir, f"output_{i}.npy"), arr)
                entry["shape"] = list(arr.shape)
            else:
                status = 3
            result["requests"].append(entry)
    finally:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
        omni.close()
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
