"""The reproducer of the context-parallel worker-exit abort (issue 34, docs/python.md "Ending a
rank's process"): runs tests/python/diffusers_cp_worker.py's Wan Ulysses-2 case on BACKEND in
2 gloo processes N times, each with core dumps allowed in its own temporary folder, and stops
at the first run whose exit codes are not [0, 0] or whose stderr says "terminate called"
(printing the folder, for `gdb .venv/bin/python FOLDER/core`).

    .venv/bin/python tools/repro/cp_exit_abort.py 100 dattn_sage

Before the worker ended with os._exit: 2 of 40 (dattn_sage), 5 of 40 (dattn), 0 of 40
(native) aborted; after: 100 of 100 clean."""
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "python")
CHILD = r"""
import sys
sys.path.insert(0, %r)
import diffusers_cp_worker as worker
rank, init, out, backend = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
worker.main(rank, 2, init, [{"model": "wan", "ring": 1, "ulysses": 2, "backend": backend}], out)
""" % HERE


def allow_cores():
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def one(backend):
    """One run: (exit codes, the stderr that says "terminate called", the run's folder)."""
    d = tempfile.mkdtemp()
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(r), f"file://{d}/rendezvous",
                               f"{d}/out.pt", backend], stderr=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, env=env, cwd=d, preexec_fn=allow_cores)
             for r in range(2)]
    errs = [p.communicate(timeout=120)[1].decode(errors="replace") for p in procs]
    return [p.returncode for p in procs], [e for e in errs if "terminate called" in e], d


def main():
    n, backend = int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "dattn_sage"
    for i in range(n):
        t = time.time()
        codes, bad, folder = one(backend)
        print(f"run {i}: exit codes {codes} ({time.time() - t:.1f} s)", flush=True)
        if codes != [0, 0] or bad:
            print(f"FAILED; cores and stderr in {folder}: {[b[-3000:] for b in bad]}")
            return 1
    print(f"{n} clean of {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
