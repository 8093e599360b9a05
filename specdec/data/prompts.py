"""Held-out code-completion prompts: prefixes of functions from the stdlib test split.

Contract: ``code_completion_prompts(n, split="test", seed=0)`` returns ``n`` prompts (fewer only if
the split has fewer functions), each ``{"id": "<relpath>:<line>", "prompt": str}``, deterministic
for a given seed and stdlib. A prompt is up to ``context_lines`` lines that precede a function
(so the model sees the file's style), then the function's decorators and signature, then its
docstring when it has one, ending just where the model should write the body. At most one function
is taken per file, so the set covers many modules. Prompts longer than ``max_chars`` are trimmed at
the front, on a line boundary. ``function_prompts(split)`` returns every such prompt of a split
(all functions of every file), for generating distillation data from the train split.

A prompt ends *before* the newline that ends its last line: a byte-level BPE merges that newline
with the next line's indentation ("\n" + spaces is one token), so a prompt ending in a bare "\n"
token would show the model a boundary it never saw in training (a bare newline is followed by an
unindented line) and it would skip the body. Ending at ":" or the docstring's quotes, the model
writes the newline-and-indent token itself.
"""

from __future__ import annotations

import ast
import random

from specdec.data.stdlib import load_split


def _function_prefixes(relpath: str, text: str, context_lines: int, max_chars: int) -> list[dict]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        first = node.body[0]
        has_doc = isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) \
            and isinstance(first.value.value, str)
        # the prompt ends after the docstring, or after the signature (the line before the first statement)
        end_line = first.end_lineno if has_doc else first.lineno - 1
        start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        while not has_doc and end_line > start and lines[end_line - 1].strip()[:1] in ("", "#"):
            end_line -= 1  # comments between the signature and the body belong to the body
        if end_line < start:  # one-line def with body on the same line
            continue
        context_start = max(0, start - 1 - context_lines)
        prompt = "".join(lines[context_start:end_line]).rstrip("\r\n")
        while len(prompt) > max_chars and "\n" in prompt:
            prompt = prompt.split("\n", 1)[1]
        if len(prompt) > max_chars or not prompt.strip():
            continue
        out.append({"id": f"{relpath}:{node.lineno}", "prompt": prompt})
    return out


def function_prompts(split: str = "train", context_lines: int = 12, max_chars: int = 1200,
                     root: str | None = None) -> list[dict]:
    """Every function-prefix prompt of one split (all functions of every file), in file order."""
    out = []
    for f in load_split(split, root):
        out.extend(_function_prefixes(f.relpath, f.text, context_lines, max_chars))
    return out


def code_completion_prompts(n: int, split: str = "test", seed: int = 0, context_lines: int = 12,
                            max_chars: int = 1200) -> list[dict]:
    """``n`` function-prefix prompts from one split, at most one per file, chosen by ``seed``."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    per_file = []
    for f in load_split(split):
        prefixes = _function_prefixes(f.relpath, f.text, context_lines, max_chars)
        if prefixes:
            per_file.append(rng.choice(prefixes))
    rng.shuffle(per_file)
    return per_file[:n]
