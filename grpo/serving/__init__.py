"""Serving: the vLLM server that samples from alpha, and everything between it and the trainer.

    server.py          the server process (`python -m grpo.serving.server`): vLLM's OpenAI app + our routes
    routes.py          its /grpo/* routes (generate, weight pushes, health)
    gate.py            bearer-token check; the gate that keeps a batch on one weights version
    engine_weights.py  what the engine serves now, and the one place that changes it (load, roll back)
    worker_ext.py      what runs inside vLLM's workers (reload, fingerprint, reseed)
    inference.py       the trainer's view: launch, generate, push, restart (`InferenceServer`, `ServerConfig`)
    client.py          HTTP client with retries / supervisor.py  the server as a child process
    weights_dir.py     a weights root on disk (names, manifest, headers, pruning), shared by both sides
    weights_writer.py  the trainer's writer of a push / weights_check.py  the server's checks of one
    fingerprint.py     does the engine hold what was pushed (moments compared after each push)

A CPU engine's own settings (threads, sampler, executor) live in the CPU fence, grpo/cpu/.
"""
