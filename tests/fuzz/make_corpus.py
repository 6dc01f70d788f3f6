#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz targets: small valid inputs under corpus/<target>/.

Run from anywhere: python3 tests/fuzz/make_corpus.py. Found crashes are committed next to these
seeds by hand (as crash-<what>), so that every run replays them."""
import json
import struct
from pathlib import Path

HERE = Path(__file__).resolve().parent


def safetensors(tensors, metadata=None):
    """tensors: [(name, dtype, shape, bytes)] -> the file's bytes, laid out in name order."""
    header, data = {}, b""
    for name, dtype, shape, payload in sorted(tensors):
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(payload)]}
        data += payload
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def f32(*xs):
    return struct.pack(f"<{len(xs)}f", *xs)


def i32(*xs):
    return struct.pack(f"<{len(xs)}i", *xs)


SAFETENSORS = {
    "empty.safetensors": safetensors([]),
    "metadata-only.safetensors": safetensors([], {"format": "pt"}),
    "one-f32.safetensors": safetensors([("t", "F32", [2, 2], f32(1, 2, 3, 4))], {"k": "v"}),
    "dtypes.safetensors": safetensors([
        ("a", "BF16", [3], b"\x80\x3f" * 3),
        ("b", "F16", [], b"\x00\x3c"),
        ("c", "I32", [2, 1], i32(7, -7)),
        ("d", "BOOL", [4], b"\x00\x01\x01\x00"),
        ("e", "F8_E4M3", [2], b"\x38\xb8"),
        ("f", "I8", [0, 3], b""),
    ]),
    "attend-thd.safetensors": safetensors([
        ("q", "F32", [3, 1, 2], f32(*range(6))),
        ("k", "F32", [3, 1, 2], f32(*range(6))),
        ("v", "F32", [3, 1, 2], f32(*range(6))),
        ("cu_seqlens_q", "I32", [3], i32(0, 1, 3)),
        ("cu_seqlens_k", "I32", [3], i32(0, 1, 3)),
    ]),
}

META = {
    "example.json": {"softmax_scale": 0.1767766952966369, "causal": False, "role": "self",
                     "attention_mask_mode": "padding"},
    "packed.json": {"qkv_layout": "THD", "max_seqlen_q": 4, "max_seqlen_k": 4,
                    "packed_padding": {"q_length": 3, "kv_length": 3}, "valid_kv_length": 3},
    "video.json": {"role": "cross", "joint_strategy": "rear",
                   "video_layout": {"prefix_len": 2, "latent_grid": [2, 2, 2]},
                   "backend_options": {"sparsity": 0.5, "tile": "2,2,2", "fallback": True,
                                       "topk": 3}},
    "spans.json": {"causal": True, "qkv_layout": "BSHD", "kv_cache_dtype": "fp8",
                   "laser_input_scale": 1.5, "q_global_start": 4, "k_global_start": 0,
                   "full_attn_spans": [[[0, 2], [4, 6]], []], "query_ranges": [[0, 2, 4]],
                   "video_layout": {"used_len": 10, "video_spans": [
                       {"start": 0, "latent_grid": [1, 2, 2], "role": "reference"},
                       {"start": 4, "latent_grid": [1, 2, 3]}]}},
}


def main():
    for name, data in SAFETENSORS.items():
        path = HERE / "corpus" / "fuzz_safetensors" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    for name, meta in META.items():
        path = HERE / "corpus" / "fuzz_attend_meta" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
