"""Log what a ``specdec serve`` process's worker thread does, one line per step, for the server bench.

Put this folder on ``PYTHONPATH`` and name a log file in ``SPECDEC_TIMELINE_LOG``; every ``specdec serve`` process
started with both (the bench's, or ``benchmarks/serve_process.py``'s) appends a line per admission of waiting requests
(``join``: the rows before and after, the joining prompts' lengths; the prefill of both models), per round (``round``:
the batch's rows) and per idle wait for a request (``idle``), each as ``start seconds kind fields``:

    PYTHONPATH=benchmarks/worker_timeline SPECDEC_TIMELINE_LOG=timeline.log OMP_NUM_THREADS=1 \\
        python benchmarks/serve_process.py --speculate off --clients 4

Findings: docs/journal/2026-11-29-weight-streams-server-time.md, "Weights read as several streams, and where the
server's time goes at 4 clients".
"""

import os
import sys
import time

if os.environ.get("SPECDEC_TIMELINE_LOG") and "serve" in sys.argv:
    from specdec import admission, decode
    from specdec.serve import engine

    _log = open(os.environ["SPECDEC_TIMELINE_LOG"], "a", buffering=1)  # noqa: SIM115 - open for the process's life; a line at a time: a server stopped by a signal loses none
    _join, _round, _take = admission.Admission.join, decode.Decoder._round, engine.Engine._take_inbox

    def _write(kind: str, start: float, **fields: object) -> None:
        seconds = time.perf_counter() - start
        _log.write(f"{start:.6f} {seconds:.6f} {kind} "
                   + " ".join(f"{k}={v}".replace(" ", "") for k, v in fields.items()) + "\n")

    def join(self, rows, add):  # the decoder's admission of waiting rows (``specdec.admission.Admission.join``)
        start, waiting, before = time.perf_counter(), len(self.waiting), len(rows)
        out = _join(self, rows, add)
        if waiting:
            _write("join", start, rows=before, after=len(rows),
                   prompts=[len(r.request.ids) for r in rows[before:]])
        return out

    def round_(self):
        start = time.perf_counter()
        out = _round(self)
        _write("round", start, rows=len(self.rows))
        return out

    def take(self, block):
        start = time.perf_counter()
        out = _take(self, block)
        if block:
            _write("idle", start)
        return out

    from specdec import target as _target

    _beside, _split, _tokens = admission._beside, _target.ModelTarget.prefill_beside, {}

    def split(self, prompts):
        run = _split(self, prompts)
        _tokens[run] = int(prompts.valid().sum())
        return run

    def beside(run):  # a prefill beside decoding, on the prefill thread (``Decoder.prefill_beside``)
        start = time.perf_counter()
        out = _beside(run)
        _write("beside", start, tokens=_tokens.pop(run, 0))
        return out

    _target.ModelTarget.prefill_beside = split

    admission.Admission.join, decode.Decoder._round, engine.Engine._take_inbox = join, round_, take
    admission._beside = beside
