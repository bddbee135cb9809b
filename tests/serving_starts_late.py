"""grpo.serving.server with a pause after its engine came up, held open for a test to kill the
engine there (tests/test_server.py): the windows in which the chaos soak killed one. Writes
ENGINE_UP_FILE (an environment variable naming a path) when the engine is up, then waits PAUSE_S.
PAUSE_AT says where: "http" (default), before the HTTP server starts; "client", inside the building
of vLLM's engine client, before its one call to the engine there (reset_mm_cache); "exit", between
an engine's death and the server's exit (its watches' os._exit comes PAUSE_S late, vLLM's own HTTP
watchdog is off, ENGINE_UP_FILE is written once it answers): the window in which a call still reaches a server whose engine is dead.

    python tests/serving_starts_late.py <grpo.serving.server arguments>
"""
import asyncio
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import vllm.entrypoints.launchers.launcher as launcher  # noqa: E402

from grpo.serving import server  # noqa: E402

PAUSE_S = float(os.environ.get("PAUSE_S", "20"))  # how long the window stays open
serve_http = launcher.serve_http


async def serve_http_late(*args, **kwargs):
    Path(os.environ["ENGINE_UP_FILE"]).write_text(str(os.getpid()))
    await asyncio.sleep(PAUSE_S)
    return await serve_http(*args, **kwargs)


def reset_mm_cache_late(original):
    async def late(self):
        Path(os.environ["ENGINE_UP_FILE"]).write_text(str(os.getpid()))
        await asyncio.sleep(PAUSE_S)
        return await original(self)
    return late


def exit_late(real_exit):
    def late(code: int) -> None:  # the watch that calls it returns; the server goes on answering meanwhile
        threading.Timer(PAUSE_S, real_exit, (code,)).start()
    return late


async def serve_http_marked(*args, **kwargs):
    async def mark_when_it_answers() -> None:
        while True:
            try:
                _, writer = await asyncio.open_connection(kwargs["host"], kwargs["port"])
            except OSError:
                await asyncio.sleep(0.1)
                continue
            writer.close()
            Path(os.environ["ENGINE_UP_FILE"]).write_text(str(os.getpid()))
            return

    marking = asyncio.ensure_future(mark_when_it_answers())  # noqa: F841 (held while it serves)
    return await serve_http(*args, **kwargs)


if __name__ == "__main__":  # not in the engine's processes, which import this module as they start
    if os.environ.get("PAUSE_AT") == "exit":
        os._exit = exit_late(os._exit)
        os.environ["VLLM_KEEP_ALIVE_ON_ENGINE_DEATH"] = "1"  # nor does vLLM's HTTP watchdog stop it (5 s)
        launcher.serve_http = serve_http_marked
    elif os.environ.get("PAUSE_AT", "http") == "client":
        from vllm.v1.engine.async_llm import AsyncLLM

        AsyncLLM.reset_mm_cache = reset_mm_cache_late(AsyncLLM.reset_mm_cache)
    else:
        launcher.serve_http = serve_http_late  # server.serve imports it from the module when it runs
    server.main()
