"""Never silently slow (docs/architecture.md): where dattn's automatic engine has no SIMD on a CPU
that has it, `dattn info` says so, automatic choices keep the host's attention (vllm-omni's
platform: tests/vllm_omni/test_platform.py) and every explicit choice runs dattn with one
warning per process. On x86 the rule is provoked with DATTN_CPU_FEATURES=portable (the mask is a
testing tool, not an opt-in); each case runs in its own process, since the features and the
warning are per process."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import dattn

MASKED = {"DATTN_CPU_FEATURES": "portable"}

# Runs `body` (which sets `calls`, what dattn computed) with every warning recorded; prints the
# FarBelowCpuWarning messages, the engines dattn's layers ran on and the calls as JSON.
HARNESS = """
import json, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    import torch, dattn
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 32) for _ in range(3))
{body}
ours = [str(w.message) for w in seen if issubclass(w.category, dattn.FarBelowCpuWarning)]
print(json.dumps({{"warnings": ours, "calls": calls, "far": dattn.far_below_cpu()}}))
"""


def run(body, env):
    code = HARNESS.format(body=textwrap.indent(textwrap.dedent(body), "    "))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                       env=dict(os.environ, **env), cwd="/")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


EXPLICIT = {
    "dattn.Attention": """
        layer = dattn.Attention(2, 32, qkv_layout="BHSD")
        out = layer.forward(q, k, v)
        out = layer.forward(q, k, v)
        calls = 2 if layer.last_engine else 0
    """,
    "dattn.scaled_dot_product_attention": """
        out = dattn.scaled_dot_product_attention(q, k, v)
        out = dattn.scaled_dot_product_attention(q, k, v)
        from dattn import torch_adapter as ta
        calls = ta.OWN.calls
    """,
    "patch_torch_sdpa": """
        with dattn.patch_torch_sdpa() as patch:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        calls = patch.calls
    """,
    "comfyui": """
        from dattn import comfyui
        ov = comfyui.override()
        flat = [t.transpose(1, 2).reshape(1, 40, 64) for t in (q, k, v)]
        out = ov(None, *flat, 2)
        out = ov(None, *flat, 2)
        calls = ov.calls
    """,
}


@pytest.mark.parametrize("who", sorted(EXPLICIT))
def test_an_explicit_choice_runs_dattn_and_warns_once(who):
    """Far below the CPU: the explicit choice still runs on dattn (its calls counted), with
    exactly one FarBelowCpuWarning naming the CPU and the engine; on the real CPU none."""
    got = run(EXPLICIT[who], MASKED)
    assert got["calls"] == 2, got
    assert len(got["warnings"]) == 1, got
    text = got["warnings"][0]
    assert "portable engine" in text and "DATTN_CPU_FEATURES=portable" in text, text
    assert got["far"] and got["far"] in text
    cpu = dattn.cpu_info()
    if cpu["brand"]:
        assert cpu["brand"] in text
    native = run(EXPLICIT[who], {"DATTN_CPU_FEATURES": ""})
    assert native["calls"] == 2 and native["warnings"] == [] and native["far"] is None, native


def test_diffusers_enable_warns_once_and_runs_dattn():
    pytest.importorskip("diffusers")
    body = """
        import dattn.diffusers as dd
        from diffusers.models.attention_processor import Attention as DiffusersAttention
        model = torch.nn.Sequential(DiffusersAttention(64, heads=2, dim_head=32)).eval()
        handle = dd.enable(model)
        x = torch.randn(1, 40, 64)
        with torch.no_grad():
            model(x); model(x)
        calls = handle.calls
    """
    got = run(body, MASKED)
    assert got["calls"] == 2 and len(got["warnings"]) == 1, got
    assert run(body, {"DATTN_CPU_FEATURES": ""})["warnings"] == []


def test_one_warning_per_process_across_entry_points():
    body = """
        layer = dattn.Attention(2, 32, qkv_layout="BHSD")
        layer.forward(q, k, v)
        dattn.scaled_dot_product_attention(q, k, v)
        with dattn.patch_torch_sdpa() as patch:
            torch.nn.functional.scaled_dot_product_attention(q, k, v)
        calls = patch.calls
    """
    got = run(body, MASKED)
    assert got["calls"] == 1 and len(got["warnings"]) == 1, got


def test_the_reference_oracle_is_not_warned_about():
    """REFERENCE is chosen to be exact, not fast: no warning."""
    got = run("""
        layer = dattn.Attention(2, 32, qkv_layout="BHSD", backend="REFERENCE")
        layer.forward(q, k, v)
        calls = 1
    """, MASKED)
    assert got["warnings"] == [] and got["far"], got


def test_info_names_the_shortfall():
    """`python -m dattn info` (and the JSON's far_below_cpu) under the mask; silent without it
    on a CPU whose SIMD an engine serves."""
    env = dict(os.environ, **MASKED)
    out = subprocess.run([sys.executable, "-m", "dattn", "info", "--threads", "1"], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("WARNING"))
    assert "far below" in line and "portable engine" in line, line
    data = json.loads(subprocess.run(
        [sys.executable, "-m", "dattn", "info", "--json", "--threads", "1"], env=env,
        capture_output=True, text=True, timeout=120, check=True).stdout)
    assert data["far_below_cpu"] and line.endswith(data["far_below_cpu"])
    features = dattn.cpu_info()["detected_features"]
    if {"avx2", "fma", "f16c"} <= set(features) and not os.environ.get("DATTN_CPU_FEATURES"):
        assert dattn.far_below_cpu() is None
