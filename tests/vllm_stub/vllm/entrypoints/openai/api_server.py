"""A stand-in for vLLM's OpenAI server in the bench's tests (tests/test_bench_vllm.py): no vLLM involved.

Run as ``python -m vllm.entrypoints.openai.api_server`` with this folder's parent on PYTHONPATH, it
takes the flags the bench gives vLLM's server, writes them (and its pid, thread settings, and the pids of
the stub servers recorded before it that are still running) to
``$STUB_RECORD/<port>.json``, then as ``$STUB_MODE`` says: ``hang`` (never listens), ``fail`` (exits 3),
or serves ``/v1/models`` and ``/v1/completions`` with the model's own greedy ``generate`` on the token
ids sent, stopping at ``stop_token_ids`` (left out of ``token_ids`` and given as ``stop_reason`` where
``$STUB_DROP_STOP`` is set, as a server may); with ``"stream": true`` as server-sent events, one chunk per
token (its ``token_ids`` delta), the last with ``finish_reason`` and ``stop_reason``, then ``[DONE]``.
Requests are served on threads (concurrent clients), one ``generate`` at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--model", "--served-model-name", "--dtype", "--max-model-len", "--host", "--port",
                 "--generation-config", "--seed", "--speculative-config"):
        parser.add_argument(flag)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)  # vLLM's own form
    args = parser.parse_args()
    earlier = [json.loads(p.read_text())["pid"] for p in Path(os.environ["STUB_RECORD"]).glob("*.json")]
    record = {"argv": sys.argv[1:], "pid": os.getpid(), "others_alive": [pid for pid in earlier if alive(pid)],
              "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE",
                                                     "VLLM_CPU_OMP_THREADS_BIND")}}
    Path(os.environ["STUB_RECORD"], f"{args.port}.json").write_text(json.dumps(record))
    mode = os.environ.get("STUB_MODE", "serve")
    print(f"stub: starting in mode {mode}", flush=True)
    if mode == "hang":
        print("stub: loading forever", flush=True)
        while True:
            time.sleep(1)
    if mode == "fail":
        print("stub: no such kernel", flush=True)
        sys.exit(3)

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    drop_stop = bool(os.environ.get("STUB_DROP_STOP"))

    class Handler(BaseHTTPRequestHandler):
        def _send(self, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._send({"object": "list", "data": [{"id": args.served_model_name, "object": "model"}]})

        def do_POST(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert request["temperature"] == 0 and request["ignore_eos"] and request["return_token_ids"]
            ids, stop = request["prompt"], request["stop_token_ids"]
            with lock, torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=request["max_tokens"], do_sample=False,
                                     eos_token_id=stop or None, pad_token_id=0,
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            tokens = out[0, len(ids):].tolist()
            reason = tokens[-1] if tokens and tokens[-1] in stop else None
            if reason is not None and drop_stop:
                tokens = tokens[:-1]
            finish = "stop" if reason is not None else "length"
            if request.get("stream"):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
                chunks = [{"index": 0, "text": "", "token_ids": [t], "finish_reason": None, "stop_reason": None}
                          for t in tokens]
                chunks.append({"index": 0, "text": "", "token_ids": [], "finish_reason": finish, "stop_reason": reason})
                for choice in chunks:
                    self.wfile.write(b"data: " + json.dumps({"id": "cmpl-stub", "object": "text_completion",
                                                             "choices": [choice]}).encode() + b"\n\n")
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
                return
            self._send({"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": request["model"],
                        "choices": [{"index": 0, "text": "", "logprobs": None, "token_ids": tokens,
                                     "finish_reason": finish,
                                     "stop_reason": reason}]})

        def log_message(self, *_) -> None:
            pass

    lock = threading.Lock()
    server = ThreadingHTTPServer((args.host, int(args.port)), Handler)
    print("stub: ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
