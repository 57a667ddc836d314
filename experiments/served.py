"""`engine-serve` as a subprocess for the hostile experiments: start it from any code
root (this checkout, or another one to compare with), read its ready line, sample
its memory from /proc, stop it.

    with Served(root=REPO, args=["--batch", "4"]) as s:
        s.url, s.rss_bytes(), s.peak_rss_bytes()
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

READY = re.compile(r"engine-serve ready: (http://[\d.]+:\d+)")


def raw_exchange(url: str, data: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes to the server at `url`, read until it closes; what came back
    (b"" if it reset the connection: a server that closes with unread input sends RST,
    which can drop its answer)."""
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    out = b""
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as c:
        try:
            c.sendall(data)
            while True:
                b = c.recv(65536)
                if not b:
                    break
                out += b
        except (ConnectionResetError, BrokenPipeError, socket.timeout):
            pass
    return out


def _status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


class Served:
    def __init__(self, root: Path, args=(), ready_timeout: float = 180.0):
        self.root = Path(root)
        self.args = list(args)
        self.ready_timeout = ready_timeout
        self.proc: Optional[subprocess.Popen] = None
        self.url = ""
        self.ready_line = ""
        self.stderr_lines: list = []

    def start(self) -> "Served":
        path = os.pathsep.join(p for p in (str(self.root), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen([sys.executable, "-m", "server.cli", "--port", "0",
                                      *self.args], cwd=self.root, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        threading.Thread(target=self._drain_err, daemon=True).start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.ready_timeout:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: "
                                   + "".join(self.stderr_lines[-20:]))
            m = READY.search(line or "")
            if m:
                self.url, self.ready_line = m.group(1), line.strip()
                threading.Thread(target=self._drain_out, daemon=True).start()
                return self
        raise RuntimeError("no ready line")

    def _drain_err(self):
        for line in self.proc.stderr:
            self.stderr_lines.append(line)

    def _drain_out(self):
        for _ in self.proc.stdout:
            pass

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_bytes(self) -> int:
        return _status_kb(self.pid, "VmRSS") * 1024

    def peak_rss_bytes(self) -> int:
        """The kernel's high-water mark of the server's RSS (VmHWM)."""
        return _status_kb(self.pid, "VmHWM") * 1024

    def terminate(self, timeout: float = 60.0) -> Optional[float]:
        """SIGTERM; seconds until it exited, or None if it had to be killed."""
        if self.proc is None or self.proc.poll() is not None:
            return 0.0
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
            return time.monotonic() - t0
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            return None

    def __enter__(self):
        return self.start()

    def __exit__(self, exc_type, *exc):
        self.terminate(20)
        if exc_type is not None:    # what the server said before a failed request
            sys.stderr.write("server stderr (last 40 lines):\n" + "".join(self.stderr_lines[-40:]))
