"""lm-evaluation-harness against `specdec serve` (``local-completions``) and against its own ``hf`` backend.

Two tasks on local data files built here from the interpreter's standard library source (no download):

- ``specdec_code_mc`` (log-likelihood, ``multiple_choice``): a few lines of code, then four candidate next lines
  (the true one and three from elsewhere); accuracy ``acc`` / ``acc_norm``. Through the server each candidate is one
  ``echo`` + ``logprobs`` + ``max_tokens: 1`` request, as lm-eval's ``local-completions`` sends them.
- ``specdec_code_gen`` (``generate_until``): the same contexts, greedy until the end of the line; ``exact_match``.

The same model runs under both backends (``models/code-target``, float32 on the CPU; the server drafts with
code-drafter). Printed: each task's metrics under both, the largest difference of a request's log-likelihood, whether
every request's is-greedy flag agrees, and whether every generated text is identical.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/lm_eval_server.py --docs 40
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "models" / "code-target"
MODULES = ["json/decoder.py", "argparse.py", "textwrap.py", "fractions.py", "shlex.py", "csv.py", "heapq.py",
           "bisect.py", "calendar.py", "pprint.py"]


def documents(n: int, seed: int = 0) -> list[dict]:
    """``n`` documents: 6 lines of stdlib code as the context, the next (non-blank) line as the target, three other
    lines as distractors."""
    import sysconfig
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines = []
    for name in MODULES:
        lines += [(name, i, line) for i, line in enumerate((stdlib / name).read_text().splitlines())]
    rng = random.Random(seed)
    pool = [line for _, _, line in lines if len(line.strip()) > 8]
    docs = []
    while len(docs) < n:
        start = rng.randrange(len(lines) - 8)
        window = lines[start:start + 7]
        if len({name for name, _, _ in window}) > 1:
            continue
        context, target = [line for _, _, line in window[:6]], window[6][2]
        if len(target.strip()) < 8 or len("\n".join(context)) > 600:
            continue
        choices = [target] + rng.sample([p for p in pool if p != target], 3)
        rng.shuffle(choices)
        docs.append({"context": "\n".join(context) + "\n", "target": target, "choices": choices,
                     "label": choices.index(target)})
    return docs


def write_tasks(folder: Path, docs: list[dict], max_gen_toks: int) -> None:
    data = folder / "code.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (folder / "mc.yaml").write_text(
        "task: specdec_code_mc\n" + common + "output_type: multiple_choice\ndoc_to_text: context\n"
        "doc_to_choice: choices\ndoc_to_target: label\ntarget_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (folder / "gen.yaml").write_text(
        "task: specdec_code_gen\n" + common + "output_type: generate_until\ndoc_to_text: context\n"
        "doc_to_target: target\ntarget_delimiter: ''\n"
        f"generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: {max_gen_toks}\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")


def evaluate(model: str, model_args: str, folder: Path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["specdec_code_mc", "specdec_code_gen"],
                                   task_manager=TaskManager(include_path=str(folder)), log_samples=True,
                                   batch_size=4)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECDEC_API_KEY": ""}
    command = [sys.executable, "-m", "specdec", "serve", "--target", str(TARGET), "--drafter", "code-drafter",
               "--device", "cpu", "--port", str(port), "--batch-size", "4", "--max-new-tokens", "64"]
    proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"specdec serve exited:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("specdec serve did not start")


def compare(hf: dict, server: dict) -> dict:
    """Per request: the largest log-likelihood difference, is-greedy agreement; per generation: identical text."""
    out: dict = {"metrics": {}}
    for task in ("specdec_code_mc", "specdec_code_gen"):
        out["metrics"][task] = {"hf": {k: v for k, v in hf["results"][task].items() if "stderr" not in k
                                       and k != "alias"},
                                "server": {k: v for k, v in server["results"][task].items()
                                           if "stderr" not in k and k != "alias"}}
    a, b = hf["samples"]["specdec_code_mc"], server["samples"]["specdec_code_mc"]
    a, b = sorted(a, key=lambda s: s["doc_id"]), sorted(b, key=lambda s: s["doc_id"])
    diffs, greedy_same, requests = [], True, 0
    for x, y in zip(a, b):
        for (ll_x, g_x), (ll_y, g_y) in zip((r[0] for r in x["resps"]), (r[0] for r in y["resps"])):
            diffs.append(abs(float(ll_x) - float(ll_y)))
            greedy_same &= bool(g_x) == bool(g_y)
            requests += 1
    a, b = hf["samples"]["specdec_code_gen"], server["samples"]["specdec_code_gen"]
    a, b = sorted(a, key=lambda s: s["doc_id"]), sorted(b, key=lambda s: s["doc_id"])
    texts_x, texts_y = [s["resps"][0][0] for s in a], [s["resps"][0][0] for s in b]
    out.update({"loglikelihood_requests": requests, "max_abs_loglikelihood_diff": max(diffs),
                "is_greedy_all_equal": greedy_same, "generations": len(texts_x),
                "generations_identical": sum(x == y for x, y in zip(texts_x, texts_y))})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=40)
    parser.add_argument("--max-gen-toks", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None, help="write the comparison here")
    args = parser.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_tasks(folder, documents(args.docs), args.max_gen_toks)
        started = time.perf_counter()
        hf = evaluate("hf", f"pretrained={TARGET},dtype=float32,device=cpu", folder)
        hf_s = time.perf_counter() - started
        port = free_port()
        proc = serve(port, folder / "server.log")
        try:
            started = time.perf_counter()
            server = evaluate("local-completions",
                              f"base_url=http://127.0.0.1:{port}/v1/completions,model=code-target,tokenizer={TARGET},"
                              "tokenizer_backend=huggingface,tokenized_requests=True,max_retries=1", folder)
            server_s = time.perf_counter() - started
        finally:
            proc.terminate()
            proc.wait(30)
        report = {**compare(hf, server), "docs": args.docs, "hf_s": hf_s, "server_s": server_s}
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
