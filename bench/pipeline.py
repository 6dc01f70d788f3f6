#!/usr/bin/env python3
"""What dattn changes in a whole DiT step: diffusers' transformers at real widths and
resolutions, random weights, reduced depth, one forward and a short denoising loop per backend.

Each (model, backend, mode) runs in its own process (same seeds: the same weights and inputs),
so its peak memory (the process's maximum resident set) and its threads are its own:

  models      flux     Flux-dev widths (24 heads x 128), 1 double + 1 single block, 1024x1024
                       (4,096 image + 512 text tokens)
              sd35     SD3.5-large widths (38 x 64), 1 joint block, 1024x1024 (4,096 + 333)
              wan      Wan 2.1 1.3B widths (12 x 128), 1 block, 480x832 x 81 frames
                       (21x30x52 = 32,760 tokens; 512 text tokens for the cross-attention)
              hunyuan  HunyuanVideo 13B widths (24 x 128), 1 dual + 1 single block, 320x512 x 33
                       frames (9x20x32 = 5,760 tokens + 256 text)
              tiny-wan a 2x8x16 grid at small widths: a check of the script (tests)
  backends    native   diffusers' own attention (PyTorch's SDPA)
              dattn    dattn.diffusers.enable(model): FLASH for every attention call of the
                       model (set_attention_backend("dattn") does not reach SD3's processors,
                       which call F.scaled_dot_product_attention themselves)
              dattn_int16  dattn.diffusers.enable(model, backend="FLASH",
                       backend_kwargs={"compute_dtype": "int16"}): FLASH on the 16-bit integer
                       lanes (avx2_int16, avx_vnni_int16, avx512_vnni_int16; f32 where none)
              dattn_sage  dattn.diffusers.enable(model, backend="SAGE")
              sparse   (video models) dattn.diffusers.enable(model, backend="VIDEO_SPARSE",
                       backend_kwargs={"sparsity": S, "dense_layers": 0})
              sparse_int8  the same with qk_dtype="int8" (the blocks on SAGE's engines)
              sparse_policy  (loop) sparse with dense_steps=--dense-steps (the first steps dense)
  modes       forward  one transformer forward (timestep 0.9 of the schedule)
              loop     --steps denoising steps of diffusers' FlowMatchEulerDiscreteScheduler on
                       random latents and random text embeddings (no CFG: one forward a step)

Per row: seconds per step (the fastest of --repeats forwards, or the loop's mean), speed-up over native, the share of
the step spent inside attention calls (timed around diffusers' attention functions: the
processors' dispatch_attention_fn and F.scaled_dot_product_attention, outermost call only),
the process's peak memory, and the error of the output, normwise relative (||x - ref|| /
||ref||): a forward's output against a native forward in float32 of the same weights and
inputs; a loop's final latents against the native loop's (--dtype; a float32 loop of Wan
would take longer than the whole benchmark). Random weights give attention no locality: the
sparse rows' error here is an upper bound of what block sparsity costs on a trained model,
whose attention concentrates near the diagonal of the grid (docs/video.md has the attention
level figures on a smooth signal).

Usage: .venv/bin/python bench/pipeline.py [--model wan ...] [--backend native ...]
           [--mode forward|loop|both] [--steps 8] [--dense-steps 2] [--sparsity 0.9]
           [--threads 2] [--dtype bf16] [--no-reference] [--json FILE]
The default (every model's forward for native, dattn, dattn_sage and the video models' sparse
rows; Wan's 8-step loop for native, dattn and sparse_policy) runs in about 30 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

MODELS = ("flux", "sd35", "wan", "hunyuan", "tiny-wan")
VIDEO = ("wan", "hunyuan", "tiny-wan")
BACKENDS = ("native", "dattn", "dattn_int16", "dattn_sage", "sparse", "sparse_int8",
            "sparse_policy")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", choices=MODELS,
                    help="repeatable; default flux, sd35, wan, hunyuan")
    ap.add_argument("--backend", action="append", choices=BACKENDS,
                    help="repeatable; default native, dattn, dattn_sage (+ sparse, sparse_int8 "
                         "for video models; sparse_policy in loops)")
    ap.add_argument("--mode", choices=("forward", "loop", "both"), default=None,
                    help="default: forward for every model, and Wan's loop")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2,
                    help="forwards per forward row, the fastest reported (these VMs are noisy)")
    ap.add_argument("--dense-steps", type=int, default=2)
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    ap.add_argument("--no-reference", action="store_true",
                    help="skip the float32 native runs (no error column)")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    ap.add_argument("--svg", metavar="FILE", help="also draw seconds per step as an SVG chart")
    ap.add_argument("--from-json", metavar="FILE",
                    help="draw --svg from a --json file of an earlier run (nothing runs)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # one run, in a child process
    return ap.parse_args(argv)


# --- one run (in a child process) ----------------------------------------------------------------


def build(model_name: str, dtype):
    """(model, inputs, timestep scale, grid or None) with seed-fixed random weights/inputs."""
    import torch

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    if model_name == "flux":
        from diffusers import FluxTransformer2DModel

        model = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
            attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
            pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
        h = w = 64
        ys, xs = torch.meshgrid(torch.arange(h).float(), torch.arange(w).float(), indexing="ij")
        inputs = dict(hidden_states=randn(1, h * w, 64), encoder_hidden_states=randn(1, 512, 4096),
                      pooled_projections=randn(1, 768), guidance=torch.tensor([3.5]),
                      img_ids=torch.stack([torch.zeros_like(ys), ys, xs], -1).reshape(-1, 3),
                      txt_ids=torch.zeros(512, 3))
        return model, inputs, "hidden_states", 1 / 1000
    if model_name == "sd35":
        from diffusers import SD3Transformer2DModel

        model = SD3Transformer2DModel(
            sample_size=128, patch_size=2, in_channels=16, num_layers=1, attention_head_dim=64,
            num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
            pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192,
            qk_norm="rms_norm")
        inputs = dict(hidden_states=randn(1, 16, 128, 128), encoder_hidden_states=randn(1, 333, 4096),
                      pooled_projections=randn(1, 2048))
        return model, inputs, "hidden_states", 1.0
    if model_name in ("wan", "tiny-wan"):
        from diffusers import WanTransformer3DModel

        if model_name == "wan":
            model = WanTransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128,
                in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960,
                num_layers=1, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                rope_max_seq_len=1024)
            latent, text = (1, 16, 21, 60, 104), (1, 512, 4096)
        else:
            model = WanTransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32,
                in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64,
                num_layers=1, rope_max_seq_len=32)
            latent, text = (1, 4, 2, 8, 16), (1, 12, 32)
        inputs = dict(hidden_states=randn(*latent), encoder_hidden_states=randn(*text))
        return model, inputs, "hidden_states", 1.0
    if model_name == "hunyuan":
        from diffusers import HunyuanVideoTransformer3DModel

        model = HunyuanVideoTransformer3DModel(
            in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128,
            num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=2,
            patch_size_t=1, text_embed_dim=4096, pooled_projection_dim=768,
            rope_axes_dim=(16, 56, 56), guidance_embeds=True)
        inputs = dict(hidden_states=randn(1, 16, 9, 40, 64), encoder_hidden_states=randn(1, 256, 4096),
                      encoder_attention_mask=torch.ones(1, 256, dtype=torch.long),
                      pooled_projections=randn(1, 768), guidance=torch.tensor([6000.0]))
        return model, inputs, "hidden_states", 1.0
    raise SystemExit(f"unknown model {model_name}")


class AttentionTimer:
    """Seconds spent inside attention calls (outermost only): diffusers' processors'
    ``dispatch_attention_fn`` and ``F.scaled_dot_product_attention``, wrapped over whatever is
    installed (diffusers' own, or dattn's hooks)."""

    def __init__(self, model):
        import torch

        self.seconds, self._depth, self._undo = 0.0, 0, []
        modules = {sys.modules.get(type(m.processor).__module__)
                   for m in model.modules() if callable(getattr(m, "processor", None))}
        for mod in [m for m in modules if m is not None and hasattr(m, "dispatch_attention_fn")]:
            self._wrap(mod, "dispatch_attention_fn")
        self._wrap(torch.nn.functional, "scaled_dot_product_attention")

    def _wrap(self, owner, attr):
        inner = getattr(owner, attr)
        timer = self

        def timed(*args, **kwargs):
            if timer._depth:
                return inner(*args, **kwargs)
            timer._depth += 1
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                timer.seconds += time.perf_counter() - t0
                timer._depth -= 1

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, inner))

    def close(self):
        for owner, attr, inner in reversed(self._undo):
            setattr(owner, attr, inner)


def run_one(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[spec["dtype"]]
    model, inputs, latent_key, tscale = build(spec["model"], dtype)
    model = model.to(dtype).eval()
    inputs = {k: (v.to(dtype) if v.is_floating_point() and k not in ("img_ids", "txt_ids")
                  else v) for k, v in inputs.items()}
    backend, handle = spec["backend"], None
    import dattn.diffusers as dd

    if backend in ("dattn", "dattn_sage"):
        handle = dd.enable(model, backend="SAGE" if backend == "dattn_sage" else None)
    elif backend == "dattn_int16":
        handle = dd.enable(model, backend="FLASH", backend_kwargs={"compute_dtype": "int16"})
    elif backend.startswith("sparse"):
        kwargs = {"sparsity": spec["sparsity"], "dense_layers": 0}
        if backend == "sparse_int8":
            kwargs["qk_dtype"] = "int8"
        if backend == "sparse_policy":
            kwargs["dense_steps"] = spec["dense_steps"]
        handle = dd.enable(model, backend="VIDEO_SPARSE", backend_kwargs=kwargs)
    # What dattn decides once per process (engine choice, the bf16 rate it measures) before
    # the timed step, not inside it.
    import dattn

    warm = torch.randn(1, 64, 2, 64).to(dtype)
    dattn.Attention(2, 64).forward(warm, warm, warm)
    timer = AttentionTimer(model)
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    steps = spec["steps"] if spec["mode"] == "loop" else 1
    scheduler.set_timesteps(max(steps, 1))
    latents = inputs.pop(latent_key)
    times = []
    with torch.no_grad():
        if spec["mode"] == "forward":
            t = torch.tensor([900.0]) * tscale
            best = None
            for _ in range(max(1, spec.get("repeats", 1))):
                if handle is not None and handle.video is not None:
                    handle.reset()  # each repeat a generation of its own: step 0
                timer.seconds = 0.0
                t0 = time.perf_counter()
                out = model(**inputs, **{latent_key: latents}, timestep=t, return_dict=False)[0]
                elapsed = time.perf_counter() - t0
                if best is None or elapsed < best[0]:
                    best = (elapsed, timer.seconds)
            times.append(best[0])
            timer.seconds = best[1]
            result = out
        else:
            for t in scheduler.timesteps:
                t0 = time.perf_counter()
                ts = (t * tscale).reshape(1)
                noise = model(**inputs, **{latent_key: latents}, timestep=ts,
                              return_dict=False)[0]
                latents = scheduler.step(noise, t, latents, return_dict=False)[0]
                times.append(time.perf_counter() - t0)
            result = latents
    timer.close()
    row = dict(spec, seconds_per_step=sum(times) / len(times), total_seconds=sum(times),
               attention_share=timer.seconds / max(sum(times), 1e-9),
               peak_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if handle is not None and handle.video is not None:
        steps = handle.stats()
        if spec["mode"] == "forward":
            steps = steps[-1:]  # the last repeat's forward
        calls = [c for s in steps for c in s["calls"]]
        sparse = [c for c in calls if c["mode"] == "sparse"]
        row["block_sparsity"] = (sum(c["block_sparsity"] for c in sparse) / len(sparse)
                                 if sparse else 0.0)
        row["selection_seconds"] = sum(c["selection_seconds"] for c in calls)
        row["grid_calls"] = {"dense": len(calls) - len(sparse), "sparse": len(sparse)}
    if handle is not None:
        row["fallbacks"] = dict(handle.fallbacks)
        handle.disable()
    if spec.get("save"):
        torch.save(result.float(), spec["save"])
    return row


# --- the driver ---------------------------------------------------------------------------------


def plan(args):
    models = args.model or ["flux", "sd35", "wan", "hunyuan"]
    runs = []
    for m in models:
        modes = [args.mode] if args.mode in ("forward", "loop") else (
            ["forward", "loop"] if args.mode == "both" else
            (["forward", "loop"] if m == "wan" else ["forward"]))
        for mode in modes:
            if args.backend:
                backends = args.backend
            elif mode == "forward":
                backends = ["native", "dattn", "dattn_sage"] + (
                    ["sparse", "sparse_int8"] if m in VIDEO else [])
            else:
                backends = ["native", "dattn"] + (["sparse_policy"] if m in VIDEO else [])
            for b in backends:
                if b.startswith("sparse") and m not in VIDEO:
                    continue
                if b == "sparse_policy" and mode != "loop":
                    continue
                runs.append((m, mode, b))
    return runs


def child(spec: dict) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker",
                           json.dumps(spec)], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"run {spec['model']} {spec['mode']} {spec['backend']} failed")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_one(json.loads(args.worker))))
        return 0
    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
        if args.svg:
            write_svg(args.svg, data["rows"], data.get("total_seconds"))
        return 0
    start = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="dattn-pipeline-")
    rows, native = [], {}
    base = dict(threads=args.threads, dtype=args.dtype, steps=args.steps, repeats=args.repeats,
                dense_steps=args.dense_steps, sparsity=args.sparsity)
    refs = {}  # forward: a float32 native run; loop: the native loop (float32 loops cost minutes)
    for m, mode, b in plan(args):
        if mode == "forward" and not args.no_reference and (m, mode) not in refs:
            path = os.path.join(tmp, f"{m}-{mode}-ref.pt")
            child(dict(base, model=m, mode=mode, backend="native", dtype="f32", save=path,
                       repeats=1))
            refs[(m, mode)] = path
        path = os.path.join(tmp, f"{m}-{mode}-{b}.pt")
        row = child(dict(base, model=m, mode=mode, backend=b, save=path))
        if (m, mode) in refs:
            import torch

            ref, got = torch.load(refs[(m, mode)]), torch.load(path)
            row["rel_err"] = float((got - ref).norm() / ref.norm())
            row["rel_err_against"] = "f32 native" if mode == "forward" else f"{args.dtype} native"
        if b == "native":
            native[(m, mode)] = row["seconds_per_step"]
            if mode == "loop":
                refs[(m, mode)] = path  # kept: the loop rows' reference
        if refs.get((m, mode)) != path:
            os.remove(path)
        row["speedup_vs_native"] = (native[(m, mode)] / row["seconds_per_step"]
                                    if (m, mode) in native else None)
        rows.append(row)
        _print_row(row)
    total = time.perf_counter() - start
    print(f"# whole benchmark: {total:.0f} s ({args.threads} threads, {args.dtype})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "total_seconds": total}, f, indent=1)
    if args.svg:
        write_svg(args.svg, rows, total)
    return 0


COLORS = {"native": "#888888", "dattn": "#1f77b4", "dattn_int16": "#17becf",
          "dattn_sage": "#2ca02c",
          "sparse": "#d62728", "sparse_int8": "#ff7f0e", "sparse_policy": "#9467bd"}


def write_svg(path: str, rows, total=None) -> None:
    """A horizontal bar per row: seconds per step, grouped by (model, mode), each group scaled
    to its own slowest bar (the groups differ by orders of magnitude)."""
    groups = []
    for r in rows:
        key = (r["model"], r["mode"])
        if not groups or groups[-1][0] != key:
            groups.append((key, []))
        groups[-1][1].append(r)
    bar, gap, left, width = 18, 26, 250, 420
    height = sum(len(g[1]) * bar + gap for g in groups) + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 170}" '
           f'height="{height}" font-family="sans-serif" font-size="12">',
           '<text x="8" y="16" font-weight="bold">bench/pipeline.py: seconds per step '
           '(bar: share of the slowest in its group)</text>']
    y = 34
    for (model, mode), rs in groups:
        out.append(f'<text x="8" y="{y + 12}" font-weight="bold">{model} {mode}</text>')
        slowest = max(r["seconds_per_step"] for r in rs)
        for r in rs:
            w = width * r["seconds_per_step"] / slowest
            sp = r.get("speedup_vs_native")
            label = f'{r["seconds_per_step"]:.2f} s' + (f" ({sp:.2f}x)" if sp else "")
            out.append(f'<text x="{left - 6}" y="{y + 13}" text-anchor="end">{r["backend"]}</text>')
            out.append(f'<rect x="{left}" y="{y + 2}" width="{w:.1f}" height="{bar - 4}" '
                       f'fill="{COLORS.get(r["backend"], "#444")}"/>')
            out.append(f'<text x="{left + w + 6:.1f}" y="{y + 13}">{label}</text>')
            y += bar
        y += gap
    if total:
        out.append(f'<text x="8" y="{height - 8}">whole run {total / 60:.1f} min</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def _print_row(r):
    if not getattr(_print_row, "header", False):
        print(f"{'model':8} {'mode':7} {'backend':13} {'s/step':>8} {'vs native':>9} "
              f"{'attn share':>10} {'peak MiB':>9} {'rel err':>9}  notes")
        _print_row.header = True
    sp = r.get("speedup_vs_native")
    err = r.get("rel_err")
    notes = ""
    if "block_sparsity" in r:
        notes = (f"block sparsity {r['block_sparsity']:.3f}, grid calls {r['grid_calls']}, "
                 f"selection {r['selection_seconds']:.2f} s")
    print(f"{r['model']:8} {r['mode']:7} {r['backend']:13} {r['seconds_per_step']:8.2f} "
          f"{'' if sp is None else f'{sp:.2f}x':>9} {r['attention_share']:10.0%} "
          f"{r['peak_mib']:9.0f} {'' if err is None else f'{err:.2e}':>9}  {notes}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
