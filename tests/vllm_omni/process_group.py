"""A command in a process group of its own under a time limit: past it the whole group (an
engine and every worker it spawned) is killed and TimeoutError raised; on return nothing of the
group is left either."""

import os
import signal
import subprocess
from pathlib import Path


def run_process(cmd, env, timeout, log_path):
    """Runs ``cmd`` (output to ``log_path``) in a new session. Returns (returncode, output);
    raises TimeoutError, the output in its message, past ``timeout`` seconds."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd="/")
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise TimeoutError(f"{' '.join(map(str, cmd))} passed its time limit of {timeout} s "
                               f"(a hang):\n{Path(log_path).read_text()[-6000:]}") from None
        finally:
            try:  # nothing of the engine's may outlive it (its workers included)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return proc.returncode, Path(log_path).read_text()
