"""``python -m dattn info [--json] [--threads N]``: what the CLI's ``dattn info`` prints (the
platform, the CPU, the measured peaks with the FLASH engines held to each, the engines, every
registered backend with its capability flags), from the bindings. The CLI's ``workloads`` line
is left out: workloads are the CLI's own (``dattn run --workload``), not the library's."""

from __future__ import annotations

import argparse
import json
import platform
import sys

from . import _core

_BF16_DOT = "BFDOT" if platform.machine().lower() in ("aarch64", "arm64") else "vdpbf16ps"
_KINDS = (("f32_fma", "f32 FMA"), ("bf16_dot", f"bf16 dot ({_BF16_DOT})"),
          ("amx_bf16", "AMX tiles (tdpbf16ps)"), ("int8_dot", "int8 dot (GOP/s)"),
          ("int16_dot", "int16 dot (GOP/s)"), ("amx_int8", "AMX int8 tiles (tdpbssd, GOP/s)"))


def _peak_kind(engine: dict):
    """The kind of peak an engine is held to (tools/dattn/measurement.cpp's rule); None: none."""
    if engine["emulated"]:
        return None
    if engine["compute_dtype"] == "f32":
        return "f32_fma"
    if engine["name"] == "amx_int8":
        return "amx_int8"
    if engine["compute_dtype"] == "int8":  # SAGE's: Q.K^T's rate
        return "int8_dot"
    if engine["compute_dtype"] == "int16":  # the 16-bit integer lanes
        return "int16_dot"
    return {"avx512_bf16": "bf16_dot", "neon_bf16": "bf16_dot", "amx": "amx_bf16"}.get(engine["name"])


def info(threads: int = 0) -> dict:
    """The data of ``dattn info --json`` (less ``workloads``)."""
    cpu = dict(_core.cpu_info())
    threads = threads if threads > 0 else cpu["default_threads"]  # as the CLI decides it
    peak = dict(_core.measure_peak_gflops(threads, 0.2))
    engines = []
    for e in _core.flash_engines():
        e = dict(e)
        engines.append({
            "name": e["name"], "rank": e["rank"], "compute_dtype": e["compute_dtype"],
            "emulated": e["emulated"], "peak_kind": _peak_kind(e),
            "available": e["unavailable_reason"] is None,
            "unavailable_reason": e["unavailable_reason"],
        })
    backends = []
    for b in _core.backends():
        b = dict(b)
        caps = {k: v for k, v in b.items()
                if k not in ("name", "description", "priority", "dtypes", "available",
                             "unavailable_reason")}
        backends.append({"name": b["name"], "description": b["description"],
                         "priority": b["priority"], "available": b["available"],
                         "unavailable_reason": b["unavailable_reason"] or None,
                         **{k: list(v) if isinstance(v, tuple) else v for k, v in caps.items()}})
    return {
        "platform": "cpu",
        "cpu": {"brand": cpu["brand"], "vendor": cpu["vendor"],
                "logical_cpus": cpu["logical_cpus"], "l2_bytes": cpu["l2_bytes"],
                "features": list(cpu["features"]), "sve_bits": cpu["sve_bits"],
                "detected_features": list(cpu["detected_features"]),
                "feature_mask": cpu["feature_mask"]},
        "far_below_cpu": cpu["far_below_cpu"],
        "threads": threads,
        "peak_gflops": {
            **{k: peak[k] for k in ("f32_fma", "bf16_dot", "bf16_dot_unavailable", "amx_bf16",
                                    "amx_bf16_unavailable", "int8_dot", "int8_dot_isa",
                                    "int8_dot_unavailable", "int16_dot", "int16_dot_isa",
                                    "int16_dot_unavailable", "amx_int8", "amx_int8_unavailable",
                                    "isa", "threads")},
            "affinity_cpus": cpu["affinity_cpus"],
        },
        "engines": engines,
        "backends": backends,
    }


def _cell(value) -> str:
    """A value as the CLI's table cell (tools/dattn/info_command.cpp's cell())."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:
        return "any"
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        return ",".join(_cell(x) for x in value) if value else "any"
    if isinstance(value, dict):
        return " ".join(f"{k}:{_cell(v)}" for k, v in value.items()) if value else "none"
    return str(value)


def format_text(data: dict) -> str:
    lines = []

    def label(name: str, text: str) -> None:
        lines.append(f"{name:<14}{text}")

    cpu = data["cpu"]
    label("platform", data["platform"])
    label("cpu", f"{cpu['brand']} ({cpu['logical_cpus']} logical CPUs)")
    features = _cell(cpu["features"]) if cpu["features"] else "none"
    if cpu["sve_bits"] > 0:
        features += f" (SVE at {cpu['sve_bits']} bits)"
    if cpu["feature_mask"] is not None:
        features += (f" (DATTN_CPU_FEATURES={cpu['feature_mask']}; "
                     f"detected {_cell(cpu['detected_features'])})")
    label("features", features)
    if data["far_below_cpu"] is not None:
        label("WARNING", data["far_below_cpu"])
    label("threads", str(data["threads"]))
    peak = data["peak_gflops"]
    label("peak timing", f"{peak['threads']} thread(s) timed together over one interval, at most "
                         f"the {peak['affinity_cpus']} CPU(s) this process may run on")
    for n, (kind, what) in enumerate(_KINDS):
        if peak[kind] is None:
            text = f"none {what}: {peak[kind + '_unavailable']}"
        else:
            text = f"{peak[kind]:.1f} {what}"
            if kind == "f32_fma":
                text += f" ({peak['isa']})"
            if kind in ("int8_dot", "int16_dot"):
                text += f" ({peak[kind + '_isa']})"
            names = [e["name"] for e in data["engines"]
                     if e["peak_kind"] == kind and e["available"]]  # the ones this CPU runs
            text += ": " + ("no engine uses it yet" if not names else
                            ("engine " if len(names) == 1 else "engines ") + ", ".join(names))
        label("peak GFLOP/s" if n == 0 else "", text)
    engines = []
    for e in data["engines"]:
        notes = [e["compute_dtype"]] if e["compute_dtype"] != "f32" else []
        notes += ["emulated"] if e["emulated"] else []
        notes += ["unavailable"] if not e["available"] else []
        engines.append(e["name"] + (f" ({', '.join(notes)})" if notes else ""))
    label("engines", ", ".join(engines))
    lines.append("")

    backends = data["backends"]
    caps = [k for k in backends[0] if k not in ("name", "description", "priority", "available",
                                                "unavailable_reason", "options")] if backends else []
    rows = ["priority", "available"] + caps
    width = max([len("backend")] + [len(r) for r in rows])
    widths = [max([len(b["name"])] + [len(_cell(b[r])) for r in rows]) for b in backends]

    def row(name, cells):
        text = f"{name:<{width}}"
        for i, c in enumerate(cells):
            text += "  " + (c if i + 1 == len(cells) else f"{c:<{widths[i]}}")
        lines.append(text)

    row("backend", [b["name"] for b in backends])
    for r in rows:
        row(r, [_cell(b[r]) for b in backends])
    lines.append("")
    for b in backends:
        lines.append(f"{b['name']}: {b['description']}")
        if b["unavailable_reason"]:
            lines.append(f"  unavailable: {b['unavailable_reason']}")
        if b.get("options") is not None:
            lines.append(f"  options: {', '.join(b['options']) or 'none'}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dattn", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="platform, CPU, peaks, engines and backends")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--threads", "-t", type=int, default=0,
                   help=f"threads for the peak measurement, 1 to {_core.cpu_info()['max_threads']}")
    args = ap.parse_args(argv)
    limit = _core.cpu_info()["max_threads"]
    if args.threads and not 1 <= args.threads <= limit:
        ap.error(f"--threads: {args.threads} is not in 1 to {limit}")
    data = info(args.threads)
    sys.stdout.write(json.dumps(data) + "\n" if args.json else format_text(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
