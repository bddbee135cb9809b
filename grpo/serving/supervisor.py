"""The inference server as a child process: start, wait for health, notice death, restart, stop.

No orphans: the child runs in its own process group (stop() signals the whole group, so vLLM's
engine and worker processes go too), stop() is registered with atexit, and the child kills
itself when this process dies (die_with_parent: PR_SET_PDEATHSIG plus a parent-pid watchdog), as
does its vLLM engine-core process when the server dies (grpo.cpu.engine).
"""
from __future__ import annotations

import atexit
import concurrent.futures
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from grpo.serving.client import ServerUnavailableError

SERVER_PID_ENV = "GRPO_SERVER_PID"  # set by grpo.serving.server for its engine's processes: the pid they die with
REFUSED_EXIT = 2  # the server's exit code when it refuses its arguments or files (as argparse does)


# The thread every server child is forked from; it lives as long as this process (an idle pool thread waits).
_SPAWNER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="server-spawn")


class StartupTimeout(ServerUnavailableError):
    """The child ran but was not healthy within its start-up time-out (starting it again would wait as long)."""


class StartupRefused(ServerUnavailableError):
    """The child exited REFUSED_EXIT while starting: it refused its arguments or files, and would again."""


class ServerProcess:
    """`python -m grpo.serving.server ...` as a child: `cmd` without --port, `server_dir` for its log and port file."""

    def __init__(self, cmd: list[str], env: dict, server_dir: Path, host: str) -> None:
        self.cmd, self.env, self.server_dir, self.host = cmd, env, Path(server_dir), host
        self.log_path = self.server_dir / "server.log"
        self.process: Optional[subprocess.Popen] = None
        self.url: Optional[str] = None
        _live.add(self)

    def start(self, port: int, healthy: Callable[[str], bool], timeout_s: float) -> str:
        """Start the child on `port` (0: any free one) and wait until healthy(url); returns the url."""
        port_file = self.server_dir / "port"
        port_file.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} starting grpo.serving.server\n".encode())
            # Spawned from one long-lived thread: the child's PR_SET_PDEATHSIG (die_with_parent) fires when
            # the thread that forked it ends, and a fleet starts and restarts its servers from short-lived threads.
            self.process = _SPAWNER.submit(
                subprocess.Popen, self.cmd + ["--port", str(port)], env=self.env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True).result()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.kill()
                died = StartupRefused if self.process.returncode == REFUSED_EXIT else ServerUnavailableError
                raise died(f"grpo.serving.server exited with code {self.process.returncode} during "
                           f"start-up; last lines of {self.log_path}:\n{self.log_tail()}")
            if port_file.is_file() and (text := port_file.read_text().strip()):
                self.url = f"http://{self.host}:{int(text)}"
                if healthy(self.url):
                    return self.url
            time.sleep(0.5)
        self.kill()
        raise StartupTimeout(f"grpo.serving.server not healthy after {timeout_s:.0f} s (server.startup_timeout_s); "
                             f"last lines of {self.log_path}:\n{self.log_tail()}")

    def death_reason(self) -> Optional[str]:
        """Why the child is gone, with its log tail; None while it runs."""
        if self.process is not None and self.process.poll() is not None:
            return (f"the grpo.serving.server process (pid {self.process.pid}) exited with code {self.process.returncode}; "
                    f"InferenceServer.restart() starts it again. Last lines of {self.log_path}:\n{self.log_tail()}")
        return None

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.is_file():
            return "(no log)"
        with open(self.log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])

    def kill(self, grace_s: float = 20.0) -> None:
        """SIGTERM the child's process group (server, engine core, workers), SIGKILL what remains."""
        if self.process is None:
            return
        pgid = self.process.pid  # start_new_session: the group id is the child's pid
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                break
            end = time.monotonic() + wait_s
            while time.monotonic() < end:
                if self.process.poll() is not None and not group_alive(pgid):
                    break
                time.sleep(0.1)
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def stop(self) -> None:
        _live.discard(self)
        self.kill()


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


_live: "set[ServerProcess]" = set()  # strong refs: atexit must reach every child


@atexit.register
def _stop_all() -> None:
    for proc in list(_live):
        proc.stop()


def die_with_parent(parent_pid: Optional[int], grace_s: float = 30.0) -> None:
    """Leave no orphan: SIGTERM on parent death (Linux prctl), plus a polling watchdog that ends
    the process `grace_s` after that SIGTERM if it is still there."""
    if parent_pid is None:
        return
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    def _watch() -> None:
        while True:
            if os.getppid() != parent_pid:  # re-parented: the trainer is gone
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(grace_s)  # give the graceful shutdown its chance, then make sure
                os._exit(1)
            time.sleep(0.5)

    if os.getppid() != parent_pid:
        raise SystemExit(f"parent {parent_pid} already gone")
    threading.Thread(target=_watch, name="parent-watch", daemon=True).start()
