"""A prefill on a second thread beside decoding steps: what each costs the other (``Decoder.prefill_beside``).

``OMP_NUM_THREADS=1 python benchmarks/prefill_beside.py``: code-target (eager, specdec's kernels), a 4-row decoding
step of one token over 150 cached positions, timed alone and while another thread prefills a 150-token prompt; the
prefill timed alone and beside the steps. Three rounds; prints the medians of each.
"""

import argparse
import statistics
import threading
import time

import torch
from transformers import DynamicCache

from specdec import kernels
from specdec.compat import cache_kwargs
from specdec.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="code-target")
    parser.add_argument("--prompt", type=int, default=150, help="prompt tokens of the prefill")
    parser.add_argument("--rows", type=int, default=4, help="rows of the decoding step")
    args = parser.parse_args()
    model = load_model(args.model, dtype=torch.float32)
    kernels.install(model)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, model.config.vocab_size, (1, args.prompt), generator=gen)
    context = torch.randint(5, model.config.vocab_size, (args.rows, args.prompt), generator=gen)
    token = torch.full((args.rows, 1), 7)
    with torch.inference_mode(), kernels.active():
        cache = DynamicCache()
        model(context, **cache_kwargs(model, cache), use_cache=True)

    def prefill() -> float:
        started = time.perf_counter()
        with torch.inference_mode(), kernels.active():
            model(prompt, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - started

    def step() -> float:
        started = time.perf_counter()
        with torch.inference_mode(), kernels.active():
            model(token, **cache_kwargs(model, cache), use_cache=True)
            cache.crop(-1)
        return time.perf_counter() - started

    prefill(), step()
    print(f"{args.model}, {torch.get_num_threads()} thread a forward; medians, ms")
    for _ in range(3):
        steps_alone = [step() for _ in range(20)]
        prefills_alone = [prefill() for _ in range(3)]
        beside: list[float] = []
        thread = threading.Thread(target=lambda out=beside: out.extend(prefill() for _ in range(3)))
        thread.start()
        steps_beside = []
        while thread.is_alive():
            steps_beside.append(step())
        thread.join()
        print(f"{args.rows}-row step alone {1e3 * statistics.median(steps_alone):.2f}, beside a prefill "
              f"{1e3 * statistics.median(steps_beside):.2f} ({len(steps_beside)} steps); {args.prompt}-token prefill "
              f"alone {1e3 * statistics.median(prefills_alone):.1f}, beside the steps "
              f"{1e3 * statistics.median(beside):.1f}")


if __name__ == "__main__":
    main()
