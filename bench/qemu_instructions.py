"""Instructions an AArch64 engine executes per multiply-add of a whole attention call, counted
under qemu-user (docs/benchmarks.md, "AArch64: the inner loops under llvm-mca"): the dynamic
counterpart of bench/mca_loops.py's per-loop count, with the packing, the softmax and the
driver included.

qemu logs every translated block's instructions (`-d in_asm`) and, with chaining off, every
block it runs (`-d exec,nochain`); the instructions executed are the sum over the blocks run of
their lengths. The CLI's `dattn run` is counted twice, with 1 and 3 timed calls after its
warm-up on the same inputs: the difference is 2 calls and nothing else (no input generation, no
process start; the CLI's peak measurement's loops, whose lengths follow qemu's speed, are left
out by symbol). Multiply-adds per call: 2 x rows x keys x D x heads (Q.K^T and P.V).

    python3 bench/qemu_instructions.py --dattn build/aarch64/tools/dattn/dattn \\
        neon sve neon_bf16:bf16 neon_dotprod:sage neon_i8mm:sage

`--by-function N` also lists each engine's N functions that execute the most per call (qemu's
name of each block's function, mangled), e.g. where SAGE's quantizing went.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

EXEC = re.compile(r"^Trace \d+: 0x[0-9a-f]+ \[[0-9a-f]+/([0-9a-f]+)/[^\]]*\] ?(\S*)")
# The CLI's peak measurement after the timed calls (cpu_peak.cpp's loops): its iteration counts
# follow the time qemu takes, so its blocks are left out of both counts.
PEAK_LOOPS = re.compile(r"fma_neon|dot_neon|fma_scalar")
INSN = re.compile(r"^0x([0-9a-f]+):")

# The workload: `small` (77 joint text rows + 256 image rows, D 64), one head.
ROWS, D, HEADS = 333, 64, 1


def executed(log: str, by_function: dict = None) -> int:
    """Instructions executed according to a qemu log of in_asm and exec lines; with
    `by_function`, also added up there per symbol (qemu's name of each block's function)."""
    sizes, total, block, first = {}, 0, 0, None
    with open(log, errors="replace") as f:
        for line in f:
            m = INSN.match(line)
            if m:
                if first is None:
                    first = int(m.group(1), 16)
                block += 1
                continue
            if first is not None and not line.strip():
                sizes[first] = block  # the end of a translated block
                first, block = None, 0
                continue
            m = EXEC.match(line)
            if m and not PEAK_LOOPS.search(m.group(2)):
                n = sizes.get(int(m.group(1), 16), 0)
                total += n
                if by_function is not None:
                    by_function[m.group(2)] = by_function.get(m.group(2), 0) + n
    return total


def count(args, engine: str, kind: str, reps: int, by_function: dict = None) -> int:
    backend = ["-b", "SAGE", "--isa", engine] if kind == "sage" else ["-b", "FLASH", "--isa", engine]
    dtype = ["--dtype", "bf16"] if kind == "bf16" else []
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "qemu.log")
        cmd = [args.qemu, "-cpu", args.cpu, "-d", "in_asm,exec,nochain", "-D", log, args.dattn,
               "run", "-w", "small", "--heads", str(HEADS), "--check-rows", "0", "-t", "1",
               "--reps", str(reps), *backend, *dtype]
        subprocess.run(cmd, check=True, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        return executed(log, by_function)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dattn", required=True, help="the AArch64 build's CLI")
    ap.add_argument("--qemu", default="qemu-aarch64")
    ap.add_argument("--cpu", default="max")
    ap.add_argument("--by-function", type=int, default=0, metavar="N",
                    help="also list each engine's N functions that execute the most per call")
    ap.add_argument("engines", nargs="+", help="ENGINE[:bf16|:sage] (bf16 inputs, SAGE)")
    args = ap.parse_args()
    macs = 2 * ROWS * ROWS * D * HEADS  # per call
    print(f"qemu-aarch64 -cpu {args.cpu}: dattn run -w small --heads {HEADS} -t 1, "
          f"{macs} multiply-adds per call")
    print("| engine | inputs | instructions per call | per multiply-add |")
    print("|---|---|---|---|")
    for spec in args.engines:
        engine, _, kind = spec.partition(":")
        f1, f3 = {}, {}
        one, three = count(args, engine, kind, 1, f1), count(args, engine, kind, 3, f3)
        per_call = (three - one) / 2
        inputs = {"bf16": "bf16", "sage": "f32, SAGE"}.get(kind, "f32")
        print(f"| {engine} | {inputs} | {per_call:,.0f} | {per_call / macs:.3f} |", flush=True)
        calls = {f: (f3.get(f, 0) - f1.get(f, 0)) / 2 for f in f3}
        for f, n in sorted(calls.items(), key=lambda x: -x[1])[:args.by_function]:
            print(f"|   {f[:90]} | | {n:,.0f} | {n / macs:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
