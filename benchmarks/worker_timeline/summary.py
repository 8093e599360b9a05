"""Sum a worker timeline (``sitecustomize.py`` beside this file): ``python benchmarks/worker_timeline/summary.py LOG``.

Prints the seconds the worker spent joining requests (their prefill), in rounds by the batch's rows, and idle, with
each one's share of the whole log's span, and the prompt tokens joined per second of joining.
"""

import sys
from collections import Counter


def main(path: str) -> None:
    seconds, count, prompt_tokens, beside_tokens = Counter(), Counter(), 0, 0
    first = last = None
    with open(path) as log:
        lines = log.read().splitlines()
    for line in lines:
        start, duration, kind, *fields = line.split()
        start, duration = float(start), float(duration)
        first = start if first is None else min(first, start)
        last = start + duration if last is None else max(last, start + duration)
        values = dict(field.split("=", 1) for field in fields)
        key = f"round of {values['rows']} rows" if kind == "round" else kind
        seconds[key] += duration
        count[key] += 1
        if kind == "beside":
            beside_tokens += int(values["tokens"])
        if kind == "join":
            prompt_tokens += sum(int(n) for n in values["prompts"].strip("[]").split(",") if n)
    span = (last or 0) - (first or 0)
    print(f"span {span:.2f} s")
    for key in sorted(seconds, key=lambda k: -seconds[k]):
        print(f"{key}: {count[key]} x {1000 * seconds[key] / count[key]:.2f} ms = {seconds[key]:.2f} s "
              f"({100 * seconds[key] / span:.0f}%)")
    if seconds["beside"]:
        print(f"prefilled {beside_tokens} prompt tokens beside decoding at "
              f"{1000 * seconds['beside'] / beside_tokens:.3f} ms a "
              "token")
    if seconds["join"]:
        print(f"joined {prompt_tokens} prompt tokens at {1000 * seconds['join'] / prompt_tokens:.3f} ms a token")


if __name__ == "__main__":
    main(sys.argv[1])
