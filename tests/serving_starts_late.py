"""grpo.serving.server with a pause between its engine coming up and its HTTP server starting: the
window in which the chaos soak killed an engine (tests/test_server.py). Writes ENGINE_UP_FILE
(an environment variable naming a path) when the engine is up, then waits PAUSE_S before serving.

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


if __name__ == "__main__":  # not in the engine's processes, which import this module as they start
    launcher.serve_http = serve_http_late  # server.serve imports it from the module when it runs
    server.main()
