"""vllm-omni's OpenAI-compatible server on dattn's CPU platform (``vllm serve MODEL --omni`` on
127.0.0.1): ``/v1/images/generations`` (Flux: a PNG) and ``/v1/videos/sync`` (Wan: an mp4),
computed by dattn (the call log); a malformed request answered 4xx while the server keeps
serving; SIGTERM shuts it down with no process of its group left."""

import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

requests = pytest.importorskip("requests")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


class Server:
    def __init__(self, model: str, workdir: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.calls = workdir / "calls.jsonl"
        self.log_path = workdir / "server.log"
        env = dict(os.environ, HF_HUB_OFFLINE="1", DIFFUSION_ATTENTION_BACKEND="DATTN",
                   DATTN_VLLM_OMNI_CALL_LOG=str(self.calls))
        vllm = Path(sys.executable).with_name("vllm")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([str(vllm), "serve", model, "--omni", "--host", "127.0.0.1",
                                      "--port", str(self.port)], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True, cwd="/")

    def wait_ready(self, timeout=240):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        pytest.fail(f"the server was not ready after {timeout} s:\n{self.tail()}")

    def tail(self) -> str:
        self.log.flush()
        return self.log_path.read_text()[-6000:]

    def stop(self, timeout=60) -> None:
        """SIGTERM, then every process of the server's group must be gone within ``timeout``."""
        pgid = self.proc.pid
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            pytest.fail(f"the server did not stop within {timeout} s of SIGTERM:\n{self.tail()}")
        deadline = time.monotonic() + 20
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _group_alive(pgid)
        if left:
            os.killpg(pgid, signal.SIGKILL)
        self.log.close()
        assert not left, "a process of the server's group outlived it"


@pytest.fixture
def server(tmp_path):
    started = []

    def start(model):
        s = Server(model, tmp_path)
        started.append(s)
        s.wait_ready()
        return s

    yield start
    for s in started:
        if s.proc.poll() is None or _group_alive(s.proc.pid):
            try:
                os.killpg(s.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _computed(calls: Path):
    """What computed the engine's Attention layer calls; no platform attribute of dattn's
    fell back to vLLM's answer."""
    records = [json.loads(line) for line in calls.read_text().splitlines()]
    fallbacks = [r["platform_fallback"] for r in records if "platform_fallback" in r]
    assert not fallbacks, fallbacks
    records = [r for r in records if "platform_fallback" not in r]
    assert records, "no call of the engine's Attention layer was recorded"
    return {tuple(r["computed_by"]) for r in records}


def test_images_are_served_and_a_bad_request_is_answered_4xx(server, models):
    from PIL import Image

    s = server(models("flux"))
    body = {"prompt": "a red cat", "size": "64x64", "n": 1, "num_inference_steps": 2, "seed": 0}
    r = requests.post(s.url + "/v1/images/generations", json=body, timeout=300)
    assert r.status_code == 200, r.text[:2000]
    image = Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"])))
    assert image.format == "PNG" and image.size == (64, 64)
    for bad in ({"prompt": "a red cat", "size": "sixty-four"}, {"size": "64x64"},
                {"prompt": "x", "n": 0}):
        r = requests.post(s.url + "/v1/images/generations", json=bad, timeout=60)
        assert 400 <= r.status_code < 500, (bad, r.status_code, r.text[:500])
    r = requests.post(s.url + "/v1/images/generations", json=dict(body, seed=1), timeout=300)
    assert r.status_code == 200, r.text[:2000]
    assert _computed(s.calls) == {("dattn:FLASH",)}
    s.stop()


def test_videos_are_served_as_mp4(server, models):
    s = server(models("wan"))
    form = {"prompt": "a red cat", "width": "64", "height": "64", "num_frames": "5",
            "num_inference_steps": "2", "seed": "0"}
    r = requests.post(s.url + "/v1/videos/sync", data=form, timeout=300)
    assert r.status_code == 200, r.text[:2000]
    assert r.headers["content-type"].startswith("video/mp4")
    assert r.content[4:8] == b"ftyp"  # an ISO base media (mp4) file
    r = requests.post(s.url + "/v1/videos/sync", data={"prompt": "x", "num_frames": "many"},
                      timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    assert _computed(s.calls) == {("dattn:FLASH",)}
    s.stop()
