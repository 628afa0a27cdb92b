"""Real ``slotread engine`` servers in subprocesses on loopback ports, to kill, pause and restart; and a
replica gone bad (``failing_replica.py``) in front of one."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

import slotread

#: the checkout under test, so the subprocesses import the same slotread as the tests
_ROOT = str(Path(slotread.__file__).resolve().parents[1])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Replica:
    """``slotread engine --model MODEL`` on a loopback port; ``log`` collects its output."""

    def __init__(self, model: str, log: Path, dtype: str = "float32") -> None:
        self.model = model
        self.dtype = dtype
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        command = [sys.executable, "-m", "slotread.cli", "engine", "--model", self.model]
        return [*command, "--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype]

    def start(self) -> Replica:
        """Start the server on its port (the same one after a kill) without waiting for it; a restart
        serves ``model`` as it is then."""
        command = self.command()
        # One thread each: two replicas and the tests share a 2-core machine.
        env = {**os.environ, "PYTHONPATH": _ROOT, "OMP_NUM_THREADS": "1"}
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        return self

    def wait_ready(self, seconds: float = 120.0) -> Replica:
        """Wait until the server lists its model."""
        deadline = time.monotonic() + seconds
        while True:
            assert self.process is not None and self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(self.url + "/v1/models", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{self.url} did not get ready:\n{self.log.read_text()[-3000:]}"
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL: connections in flight break, new ones are refused."""
        assert self.process is not None
        self.process.kill()
        self.process.wait(30)

    def pause(self) -> None:
        """SIGSTOP: connections are accepted by the kernel and never answered."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.resume()
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)


@contextmanager
def started_replicas(model: str, logs: Path, count: int = 2) -> Iterator[list[Replica]]:
    """``count`` replicas of ``model`` started together, ready on entry, stopped on exit (``logs``: their
    ``engine-N.log`` files)."""
    replicas = [Replica(model, logs / f"engine-{index}.log").start() for index in range(count)]
    try:
        for replica in replicas:
            replica.wait_ready()
        yield replicas
    finally:
        for replica in replicas:
            replica.stop()


class FailingReplica(Replica):
    """A replica that answers every read 500 and lists ``real``'s model (``failing_replica.py``)."""

    def __init__(self, real: Replica, log: Path) -> None:
        super().__init__(real.model, log)
        self.real = real

    def command(self) -> list[str]:
        script = Path(__file__).with_name("failing_replica.py")
        return [sys.executable, str(script), self.real.url, str(self.port)]
