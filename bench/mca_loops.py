"""The engines' inner loops under llvm-mca: predicted cycles per iteration against the core's
multiply-add throughput (docs/benchmarks.md, "AArch64: the inner loops under llvm-mca").

For each (object file, function, CPU model) it disassembles the function as compiled (objdump),
takes its innermost loop with the most multiply-adds (a backward branch whose body holds no
other backward branch: the micro-kernel's step over one channel or key), and asks llvm-mca for
its steady-state cycles per iteration. The fraction of peak the loop can reach is

    (multiply-adds per iteration / multiply-adds the core retires per cycle) / predicted cycles

where the core's rate is its vector FMA pipes (its own figure, given per model below), and the
loop's instructions per scalar multiply-add (instructions / (FMAs x lanes)), the static
counterpart of the instructions a core retires per multiply-add. No hardware is needed: this
is what the loops permit, not what a core measured.

    python3 bench/mca_loops.py --aarch64-object-dir build/aarch64/CMakeFiles/dattn.dir/src/backends/flash/cpu \\
        --x86-object-dir build/release/CMakeFiles/dattn.dir/src/backends/flash/cpu
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys

# Each engine: (the object file's key, the C++ namespace of its loops, the multiply-add
# mnemonic, scalar multiply-adds per instruction, and its steps' functions: demangled names of
# the step and the micro-kernels it may call out of line).
F32_STEPS = (("Q.K^T", ("qk", "qk_rows", "qk_keys")), ("P.V", ("pv", "pv_chunk", "pv_rows")))
INT8_STEPS = (("Q.K^T", ("int8_qk", "int8_qk_keys")),)
ENGINES = {
    "neon": ("neon", "neon_impl", r"^fmla\b", 4, F32_STEPS),
    # The sve engine's builds: FMLA on 4, 8 and 16 f32 lanes.
    "sve (128-bit)": ("sve128", "sve128_impl", r"^fmla\b", 4, F32_STEPS),
    "sve (256-bit)": ("sve256", "sve256_impl", r"^fmla\b", 8, F32_STEPS),
    "sve (512-bit)": ("sve512", "sve512_impl", r"^fmla\b", 16, F32_STEPS),
    # BFDOT: 4 f32 lanes of 2 bf16 products.
    "neon_bf16": ("neon_bf16", "neon_bf16_impl", r"^bfdot\b", 8, F32_STEPS),
    # SDOT / USDOT: 4 int32 lanes of 4 byte products (Q.K^T; P.V is neon's FMLA by default).
    "neon_dotprod": ("int8_neon", "int8_neon_impl", r"^sdot\b", 16, INT8_STEPS),
    "neon_i8mm": ("int8_neon", "int8_neon_impl", r"^usdot\b", 16, INT8_STEPS),
    "avx2": ("avx2", "avx2_impl", r"^vfmadd\w*ps\b", 8, F32_STEPS),
    "avx512": ("avx512", "avx512_impl", r"^vfmadd\w*ps\b", 16, F32_STEPS),
}

KERNELS = [(engine, step, tuple(f"dattn::flash::{ns}::{f}<" for f in functions))
           for engine, (_, ns, _, _, steps) in ENGINES.items()
           for step, functions in steps]

# CPU models: (llvm-mca -mcpu, triple, the engine's multiply-add instructions retired per cycle).
# FMLA: Neoverse N1 2 x 128-bit FP pipes; V1 4 x 128-bit NEON (2 x 256-bit SVE); V2 4 x 128-bit.
# SDOT, USDOT, BFDOT: 2 per cycle on N1, 4 on V1 and V2 (llvm-mca's models; N1 has neither BF16
# nor I8MM). Zen 3: 2 x 256-bit FMA; Zen 4: 2 x 256-bit (a 512-bit FMA takes both: 1 per cycle).
MODELS = {
    "neon": [("neoverse-n1", "aarch64", 2), ("neoverse-v1", "aarch64", 4),
             ("neoverse-v2", "aarch64", 4)],
    # SVE's FMLA: Neoverse V2 4 x 128-bit; V1 2 x 256-bit; A64FX 2 x 512-bit.
    "sve (128-bit)": [("neoverse-v2", "aarch64", 4)],
    "sve (256-bit)": [("neoverse-v1", "aarch64", 2)],
    "sve (512-bit)": [("a64fx", "aarch64", 2)],
    "neon_bf16": [("neoverse-v1", "aarch64", 4), ("neoverse-v2", "aarch64", 4)],
    "neon_dotprod": [("neoverse-n1", "aarch64", 2), ("neoverse-v1", "aarch64", 4),
                     ("neoverse-v2", "aarch64", 4)],
    "neon_i8mm": [("neoverse-v1", "aarch64", 4), ("neoverse-v2", "aarch64", 4)],
    "avx2": [("znver3", "x86_64", 2), ("znver4", "x86_64", 2)],
    "avx512": [("znver4", "x86_64", 1)],
}


def tool(*names):
    for n in names:
        if shutil.which(n):
            return n
    return None


def disassemble(objdump: str, obj: str, prefixes) -> list:
    """[[(address, mnemonic, operands)] per function] of the functions whose demangled names
    start with one of `prefixes` (after a "void " return type)."""
    out = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", obj], check=True,
                         capture_output=True, text=True).stdout
    aarch64 = "aarch64" in objdump
    functions, lines, inside = [], [], False
    for line in out.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if head:
            name = head.group(1)
            name = name[5:] if name.startswith("void ") else name
            inside = name.startswith(tuple(prefixes))
            lines = []
            if inside:
                functions.append(lines)
            continue
        if not inside:
            continue
        m = re.match(r"^\s+([0-9a-f]+):\s+(\S+)\s*(.*)$", line)
        if m:
            ops = m.group(3).split("//")[0]  # AArch64's comments
            if not aarch64:
                ops = ops.split("#")[0]  # AT&T's ('#' starts an AArch64 immediate)
            lines.append((int(m.group(1), 16), m.group(2), ops.strip()))
    return functions


BRANCH = re.compile(r"^(b\.\w+|b|cbn?z|tbn?z|j\w+)$")


def backward_target(addr: int, mnemonic: str, ops: str):
    """The target of a branch at `addr` when it jumps backward, else None."""
    if not BRANCH.match(mnemonic):
        return None
    target = re.search(r"\b([0-9a-f]+) <", ops)
    t = int(target.group(1), 16) if target else None
    return t if t is not None and t < addr else None


def innermost_loop(code: list, fma: re.Pattern):
    """(FMAs, body [target .. branch]) of the backward branch with the most FMAs whose body
    holds no other backward branch; None without one."""
    best = None
    for addr, mn, ops in code:
        t = backward_target(addr, mn, ops)
        if t is None:
            continue
        body = [c for c in code if t <= c[0] <= addr]
        if any(backward_target(*c) is not None for c in body[:-1]):
            continue
        n = sum(1 for c in body if fma.match(c[1]))
        if n and (best is None or n > best[0]):
            best = (n, body)
    return best


def mca(llvm_mca: str, triple: str, cpu: str, body: list) -> float:
    """Steady-state cycles per iteration of `body` (its final branch made a jump to the top)."""
    text = ["loop:"]
    for _, mn, ops in body[:-1]:
        if BRANCH.match(mn):
            continue  # a forward branch inside the body: not taken in the steady state
        ops = re.sub(r"\s*<[^>]*>", "", ops)
        text.append(f"  {mn} {ops}")
    text.append("  b loop" if triple == "aarch64" else "  jmp loop")
    syntax = [] if triple == "aarch64" else ["--x86-asm-syntax=att"]
    r = subprocess.run([llvm_mca, f"-mtriple={triple}", f"-mcpu={cpu}", "-iterations=200",
                        *syntax], input="\n".join(text) + "\n", capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"llvm-mca {cpu}: {r.stderr[-800:]}")
    cycles = float(re.search(r"Total Cycles:\s+(\d+)", r.stdout).group(1))
    iters = float(re.search(r"Iterations:\s+(\d+)", r.stdout).group(1))
    return cycles / iters


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--aarch64-object-dir", help="the AArch64 build's kernel objects' directory")
    ap.add_argument("--x86-object-dir", help="the x86 build's kernel objects' directory")
    ap.add_argument("--llvm-mca", default=tool("llvm-mca-19", "llvm-mca"))
    args = ap.parse_args()
    objects = {}
    for engine, (key, *_rest) in ENGINES.items():
        arm = engine.startswith(("neon", "sve"))
        where = args.aarch64_object_dir if arm else args.x86_object_dir
        if where:
            objects[engine] = (f"{where}/kernels_{key}.cpp.o",
                               tool("aarch64-linux-gnu-objdump") if arm else "objdump")
    print(f"llvm-mca: {args.llvm_mca}")
    print("| engine | loop | multiply-add instructions / iteration | instructions per multiply-add "
          "| CPU model | multiply-add instructions / cycle | predicted cycles | cycles at that bound "
          "| fraction of peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    for engine, step, funcs in KERNELS:
        if engine not in objects:
            continue
        obj, objdump = objects[engine]
        mnemonic, macs = ENGINES[engine][2], ENGINES[engine][3]
        loops = [innermost_loop(f, re.compile(mnemonic)) for f in disassemble(objdump, obj, funcs)]
        loops = [x for x in loops if x]
        if not loops:
            print(f"| {engine} | {step} | no loop found | | | | | | |")
            continue
        n, body = max(loops, key=lambda x: x[0])
        for cpu, triple, rate in MODELS[engine]:
            cyc = mca(args.llvm_mca, triple, cpu, body)
            bound = n / rate
            per = len(body) / (n * macs)
            print(f"| {engine} | {step} ({len(body)} instructions) | {n} | {per:.3f} | {cpu} | "
                  f"{rate} | {cyc:.2f} | {bound:.2f} | {min(1.0, bound / cyc):.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
