"""A grpo.serving.server started by hand, as docs/layouts.md starts one, for tests whose runs attach
to it (server.url) instead of each launching its own engine (15-30 s of start-up on 2 cores).

Its command line and environment are those a run gives the CPU server it launches with the same
`server:` section (grpo.serving.inference.server_command, grpo.cpu.serving.engine_env), so attached
runs sample as launched ones would; each run that attaches resets it to its model directory first
(start_versions). It runs in a session of its own: a test that SIGKILLs a run's process group (or
a sweep's) leaves it serving. It exits with the test process (--parent-pid).
"""
from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

from grpo.cpu import CPUConfig
from grpo.cpu.serving import engine_env
from grpo.serving.client import InferenceClient
from grpo.serving.inference import ServerConfig, server_command, serving_dtype

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def standalone_server(model_dir: Path, work: Path, cfg: ServerConfig, startup_s: float = 400):
    """Yields (url, token_file): the server a run with this `server:` section would launch."""
    work.mkdir(parents=True, exist_ok=True)
    token_file, port_file, log = work / "token", work / "port", work / "server.log"
    token_file.write_text(secrets.token_urlsafe(24))
    token_file.chmod(0o600)
    (work / "weights").mkdir(mode=0o700)
    cpu = CPUConfig()
    cmd = server_command(cfg, Path(model_dir), work / "weights", work, serving_dtype(cfg, model_dir, on_cpu=True),
                         0.85) + ["--cpu-sampler", cpu.engine_sampler, "--cpu-executor", cpu.engine_executor]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **engine_env(cpu)}, stdout=subprocess.DEVNULL,
                            stderr=open(log, "wb"), start_new_session=True)
    try:
        deadline = time.monotonic() + startup_s
        client = None
        while proc.poll() is None and time.monotonic() < deadline:
            if port_file.is_file() and port_file.read_text().strip():
                client = InferenceClient(f"http://127.0.0.1:{port_file.read_text().strip()}",
                                         token_file.read_text().strip(), retry_deadline_s=1)
                if client.health():
                    break
            time.sleep(0.5)
        assert client is not None and client.health(), log.read_text()[-3000:]
        yield client.url, token_file
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def standalone_attach(model_dir: Path, work: Path, config: str):
    """The server a run of `config` (a YAML file) would launch, started by hand: yields the
    overrides that attach a run to it (server.url, server.token_file, server.weights_root)."""
    from grpo.config import load_config
    from grpo.train_config import TrainConfig

    cfg = load_config(TrainConfig, config, [f"model.path={model_dir}"]).server
    with standalone_server(model_dir, work, cfg) as (url, token_file):
        yield [f"server.url={url}", f"server.token_file={token_file}", f"server.weights_root={work / 'weights'}"]
