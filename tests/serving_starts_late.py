"""grpo.serving.server with a pause after its engine came up, held open for a test to kill the
engine there (tests/test_server.py): the windows in which the chaos soak killed one. Writes
ENGINE_UP_FILE (an environment variable naming a path) when the engine is up, then waits PAUSE_S.
PAUSE_AT says where: "http" (default), before the HTTP server starts; "client", inside the building
of vLLM's engine client, before its one call to the engine there (reset_mm_cache).

    python tests/serving_starts_late.py <grpo.serving.server arguments>
"""
import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import vllm.entrypoints.launchers.launcher as launcher  # noqa: E402

from grpo.serving import server  # noqa: E402

PAUSE_S = 20.0
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


if __name__ == "__main__":  # not in the engine's processes, which import this module as they start
    if os.environ.get("PAUSE_AT", "http") == "client":
        from vllm.v1.engine.async_llm import AsyncLLM

        AsyncLLM.reset_mm_cache = reset_mm_cache_late(AsyncLLM.reset_mm_cache)
    else:
        launcher.serve_http = serve_http_late  # server.serve imports it from the module when it runs
    server.main()
