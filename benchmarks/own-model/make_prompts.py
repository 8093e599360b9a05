"""The user's prompts for the own-model goals of issue 26: N code prompts, each a function's signature and
the start of its docstring, from site-packages packages held out from the target's training code
(make_target.HELD_OUT_PACKAGES: split by package, so no prompt comes from a file the target saw).

    python benchmarks/own-model/make_prompts.py --out /work/scratch/own-goal/prompts.jsonl --n 400

Writes JSONL, one {"id": "<package path>:<line>", "prompt": str} per line (a prompt spans lines, so
plain text one-per-line cannot hold it): `specdec data outputs --prompts` and `specdec bench
--prompts` both read it.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import textwrap

from make_target import HELD_OUT_PACKAGES, package_files, read, site_packages


def prompts_of(relpath: str, text: str, words: int) -> list[dict]:
    """Each documented function's def line(s), dedented, and the first ``words`` words of its docstring."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        doc = node.body[0]
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        head = lines[node.lineno - 1 : doc.lineno - 1]  # the def line(s), decorators left out
        first = lines[doc.lineno - 1]
        quote = first.lstrip()[:3]
        if quote not in ('"""', "'''") or len(head) > 6 or start < 1:
            continue
        opening = first[: first.index(quote) + 3]
        rest = first[first.index(quote) + 3 :].split()
        prompt = textwrap.dedent("\n".join(head + [opening + " ".join(rest[:words])]))
        if not rest or len(prompt) > 400:
            continue
        out.append({"id": f"{relpath}:{node.lineno}", "prompt": prompt})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=400)
    p.add_argument("--words", type=int, default=3, help="docstring words kept")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    found, seen = [], set()
    for f in package_files(HELD_OUT_PACKAGES):
        for item in prompts_of(f.relative_to(site_packages()).as_posix(), read(f), args.words):
            if item["prompt"] not in seen:
                seen.add(item["prompt"])
                found.append(item)
    rng = random.Random(args.seed)
    chosen = rng.sample(found, args.n)
    with open(args.out, "w", encoding="utf-8") as fh:
        for item in chosen:
            fh.write(json.dumps(item) + "\n")
    print(f"{len(chosen)} prompts of {len(found)} documented functions in {', '.join(HELD_OUT_PACKAGES)} -> {args.out}")


if __name__ == "__main__":
    main()
