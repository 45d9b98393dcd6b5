"""Stand-in for vLLM's OpenAI-compatible server where no vLLM is installed: the same command line
(`<python> -m vllm.entrypoints.openai.api_server --model ... --host ... --port ...`, and `-m serving.plugin
--check`) and the same HTTP (/health, /v1/models, /v1/completions with token ids in and out, `return_token_ids`,
`logprobs`, `prompt_logprobs`, `kv_transfer_params`), backed by a transformers model. A request to a server started
with `--speculative-config` (method extract_hidden_states) and `--kv-transfer-config` gets its prompt's hidden
states written as the hidden-states connector writes them: `hidden_states` [T, n_ids, H] for vLLM's aux layer ids,
ascending (id k = the output of decoder layer k-1, id num_layers before the final norm), `token_ids` [T], at the
request's `kv_transfer_params.hidden_states_path` when the connector's `allow_custom_save_path` is on (else
`<shared_storage_path>/<request id>.safetensors`), beside a `.lock` file, the path returned in the answer's
`kv_transfer_params` as vLLM does. With `kv_transfer_params.include_output_tokens` the file holds, as vLLM's
connector saves it, every token fed through the model: the prompt and the generated tokens but the last (their
states from one forward over those tokens). Like vLLM it starts a child process of its own (vLLM's engine core), which must
go down with it. It lets `make test` run prep's side (the servers' start, devices and environment, requests,
reading, checks, shards, resume, stops) without vLLM; the real server is tests/test_prep_capture_vllm.py's opt-in
test.

Environment: STANDIN_VERSION (what --check reports, default the version needed), STANDIN_LOG (appends
`server {json}` per server started: pid, child pid, port, devices, environment; `generate` / `capture probe` /
`capture sample` per request), STANDIN_FAIL_AT_START=<reason> (log `ValueError: <reason>` and exit 1 before serving,
as vLLM refusing its settings), STANDIN_HANG=1 (accept completions and never answer), STANDIN_FAIL_AFTER=n (exit 3
when asked for capture n+1, after n captures: a crash mid-capture), STANDIN_FAIL_AFTER_GENERATE=n (the same at
generate request n+1: a crash mid-regeneration), STANDIN_SLOW_S (seconds added to each request),
STANDIN_BAD_TOKENS=1 (the wrong token ids in every file), STANDIN_OTHER_HEAD=1 (next-token choices that are not the
target head's), STANDIN_TORN=1 (every completion's answer cut short: fewer bytes than its Content-Length),
STANDIN_DEVICES=n (the CUDA devices --check reports), STANDIN_FAIL_DEVICES=<ids> (the server given those
CUDA_VISIBLE_DEVICES crashes at its first generate request: one rank's server failing), STANDIN_TOKEN_S (seconds
between a streamed answer's tokens, streams interleaving as a batching engine's do), STANDIN_STALL_TOKEN=<id> (a
streamed request whose prompt starts with that id sends its first event and then nothing: one stuck request among
others that progress). /metrics gives vLLM's prompt and generation token counters; a slow request (STANDIN_SLOW_S)
raises the prompt counter while it works, a hanging one (STANDIN_HANG) does not. Requests are computed one at a
time, as a queue; a request with "stream": true gets vLLM's server-sent events (one per generated token, its
`token_ids`, the last with its finish_reason, then `[DONE]`). STANDIN_LOG gets `in flight <n>` whenever the number of
requests open at once reaches a new high, and with STANDIN_LOG_PROMPTS=1 `prompt <hash> <length>` per request.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

MIN_VLLM = "0.32.0"


def standin_python(tmp_path: Path) -> str:
    """An executable that takes the vLLM python's place: this module under the suite's interpreter."""
    path = tmp_path / "standin-python"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" "$@"\n')
    path.chmod(0o755)
    return str(path)


def log(line: str) -> None:
    if os.environ.get("STANDIN_LOG"):
        with open(os.environ["STANDIN_LOG"], "a") as f:
            f.write(line + "\n")


def check() -> int:
    version = os.environ.get("STANDIN_VERSION", MIN_VLLM)
    ok = tuple(map(int, version.split("."))) >= tuple(map(int, MIN_VLLM.split(".")))
    devices = int(os.environ.get("STANDIN_DEVICES", 0))
    print(json.dumps({"ok": ok, "version": version, "needed": MIN_VLLM, "cuda": devices > 0, "device_count": devices,
                      "reason": "" if ok else f"vLLM {version} is older than {MIN_VLLM}"}))
    return 0


class Model:
    def __init__(self, args):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
        spec = json.loads(args.speculative_config) if args.speculative_config else {}
        hf = spec.get("draft_model_config", {}).get("hf_config", {})
        self.layer_ids = list(hf.get("eagle_aux_hidden_state_layer_ids", []))
        kv = json.loads(args.kv_transfer_config) if args.kv_transfer_config else {}
        extra = kv.get("kv_connector_extra_config", {})
        self.storage, self.custom = extra.get("shared_storage_path"), bool(extra.get("allow_custom_save_path"))
        self.max_len = args.max_model_len
        self.lock = threading.Lock()
        self.seen: dict = {}
        self.model.model.norm.register_forward_pre_hook(lambda _m, a: self.seen.__setitem__("norm_in", a[0]))
        self.requests = itertools.count()
        self.prompt_tokens = self.generation_tokens = 0
        self.captures = itertools.count(1)
        self.generates = itertools.count(1)
        self.open = self.most_open = 0
        self.open_lock = threading.Lock()

    def opened(self, delta: int) -> None:
        with self.open_lock:
            self.open += delta
            if self.open > self.most_open:
                self.most_open = self.open
                log(f"in flight {self.open}")

    def states(self, out):
        """[T, n_ids, H] for vLLM's aux layer ids of a forward's output (id num_layers: the final norm's input)."""
        hs = out.hidden_states
        layers = self.model.config.num_hidden_layers
        return self.torch.stack([hs[k][0] if k < layers else self.seen["norm_in"][0] for k in self.layer_ids],
                                dim=1).contiguous()

    def complete(self, body: dict) -> dict:
        torch = self.torch
        prompt = list(body["prompt"])
        if len(prompt) + int(body.get("max_tokens", 16)) > self.max_len:
            raise ValueError(f"This model's maximum context length is {self.max_len} tokens")
        n = next(self.requests)
        params = body.get("kv_transfer_params") or {}
        capture = int(body.get("max_tokens", 16)) == 1
        if os.environ.get("STANDIN_LOG_PROMPTS"):
            log(f"prompt {hash(tuple(prompt))} {len(prompt)}")
        if capture:
            log("capture probe" if body.get("prompt_logprobs") else "capture sample")
            if next(self.captures) == int(os.environ.get("STANDIN_FAIL_AFTER", -2)) + 1:
                os._exit(3)
        else:
            log("generate")
            if next(self.generates) == int(os.environ.get("STANDIN_FAIL_AFTER_GENERATE", -2)) + 1:
                os._exit(3)
            if os.environ.get("STANDIN_FAIL_DEVICES") and os.environ.get("CUDA_VISIBLE_DEVICES") == os.environ[
                    "STANDIN_FAIL_DEVICES"]:
                print("RuntimeError: CUDA error: an illegal memory access was encountered", flush=True)
                os._exit(1)
        with self.lock, torch.no_grad():
            # working: the token counters rise while the request has not answered yet
            end = time.monotonic() + float(os.environ.get("STANDIN_SLOW_S", 0))
            while time.monotonic() < end:
                time.sleep(0.05)
                self.prompt_tokens += 1
            self.prompt_tokens += len(prompt)
            ids = torch.tensor([prompt])
            out = self.model(input_ids=ids, output_hidden_states=True)
            logp = out.logits[0].float().log_softmax(-1)
            if os.environ.get("STANDIN_OTHER_HEAD"):  # an engine whose own logits are not the prep head's
                logp = logp.roll(1, dims=-1)
            top = logp.max(-1)
            states = None
            if self.layer_ids:
                states = self.states(out)
            if capture:
                new, reason = [int(top.indices[-1])], "length"
            else:
                stop = list(body.get("stop_token_ids") or [])
                gen = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                          max_new_tokens=int(body["max_tokens"]), eos_token_id=stop or None,
                                          pad_token_id=(stop or [0])[0])
                new = gen[0, len(prompt):].tolist()
                end = next((j for j, t in enumerate(new) if t in stop), None)
                new, reason = (new, "length") if end is None else (new[: end + 1], "stop")
            if self.layer_ids and params.get("include_output_tokens") and len(new) > 1:
                # what vLLM's connector saves then: all_token_ids[:-1], the last sampled token never fed
                ids = torch.tensor([prompt + new[:-1]])
                states = self.states(self.model(input_ids=ids, output_hidden_states=True))
        self.generation_tokens += len(new)
        answer_params = None
        if states is not None:
            path = params.get("hidden_states_path") if self.custom else None
            path = path or os.path.join(self.storage, f"standin-{n}.safetensors")
            file_ids = ids[0] + 1 if os.environ.get("STANDIN_BAD_TOKENS") else ids[0]
            from safetensors.torch import save_file

            os.makedirs(os.path.dirname(path), exist_ok=True)
            Path(path + ".lock").touch()
            save_file({"hidden_states": states, "token_ids": file_ids}, path)
            answer_params = {"hidden_states_path": path}
        choice = {"index": 0, "text": "", "finish_reason": reason, "token_ids": new,
                  "logprobs": {"token_logprobs": [float(top.values[-1])]} if body.get("logprobs") else None,
                  "prompt_logprobs": None}
        if body.get("prompt_logprobs"):
            choice["prompt_logprobs"] = [None] + [
                {str(int(t)): {"logprob": float(v), "rank": 1}} for t, v in zip(top.indices[:-1], top.values[:-1])]
        return {"id": f"cmpl-{n}", "object": "text_completion", "choices": [choice],
                "kv_transfer_params": answer_params}


def serve(args) -> int:
    if os.environ.get("STANDIN_FAIL_AT_START"):
        print(f"ValueError: {os.environ['STANDIN_FAIL_AT_START']}", flush=True)
        return 1
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])  # "the engine core"
    model = Model(args)
    log("server " + json.dumps({"pid": os.getpid(), "child": child.pid, "port": args.port, "layers": model.layer_ids,
                                "devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "model": args.model,
                                "tp": args.tensor_parallel_size, "env": sorted(os.environ),
                                "key": bool(os.environ.get("VLLM_API_KEY"))}))
    key = os.environ.get("VLLM_API_KEY")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:
            pass

        def _send(self, code: int, obj, torn: bool = False) -> None:
            data = json.dumps(obj).encode() if not isinstance(obj, bytes) else obj
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: len(data) // 2] if torn else data)
            if torn:
                self.wfile.flush()
                self.close_connection = True

        def _authorized(self) -> bool:
            if key and self.headers.get("Authorization") != f"Bearer {key}":
                self._send(401, {"error": "Unauthorized"})
                return False
            return True

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/v1/models" and self._authorized():
                self._send(200, {"data": [{"id": args.model, "max_model_len": args.max_model_len}]})
            elif self.path == "/metrics":
                self._send(200, (f"vllm:prompt_tokens_total{{model_name=\"m\"}} {float(model.prompt_tokens)}\n"
                                 f"vllm:generation_tokens_total{{model_name=\"m\"}} {float(model.generation_tokens)}\n"
                                 ).encode())
            elif self.path != "/v1/models":
                self._send(404, {})

        def _events(self, answer: dict, stall: bool) -> None:
            """The answer as vLLM streams it: an event per generated token, the last with the finish reason."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            choice = answer["choices"][0]
            tokens = choice["token_ids"]
            for j, t in enumerate(tokens):
                last = j == len(tokens) - 1
                event = {"id": answer["id"], "object": "text_completion", "choices": [
                    {"index": 0, "text": "", "token_ids": [t], "finish_reason": choice["finish_reason"] if last
                     else None}]}
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
                if stall:
                    time.sleep(3600)
                time.sleep(float(os.environ.get("STANDIN_TOKEN_S", 0)))
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

        def do_POST(self) -> None:
            if not self._authorized():
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if os.environ.get("STANDIN_HANG"):
                time.sleep(3600)
            model.opened(+1)
            try:
                answer = model.complete(body)
                if body.get("stream"):
                    stall = str(body["prompt"][0]) == os.environ.get("STANDIN_STALL_TOKEN")
                    self._events(answer, stall)
                else:
                    self._send(200, answer, torn=bool(os.environ.get("STANDIN_TORN")))
            except ValueError as e:
                self._send(400, {"error": {"message": str(e)}})
            except (BrokenPipeError, ConnectionResetError):  # the client went away (it cancelled the request)
                pass
            finally:
                model.opened(-1)

    class Server(ThreadingHTTPServer):
        request_queue_size = 2048  # uvicorn's backlog, as vLLM serves: a client's burst of connections is taken

    server = Server((args.host, args.port), Handler)
    server.daemon_threads = True
    print("Application startup complete.", flush=True)
    server.serve_forever()
    return 0


def main(argv: list[str]) -> int:
    if "--check" in argv:
        return check()
    p = argparse.ArgumentParser()
    p.add_argument("-m")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--speculative-config")
    p.add_argument("--kv-transfer-config")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args, _ = p.parse_known_args(argv)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
