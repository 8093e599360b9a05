"""Log every trial round of ``speculate="auto"`` in a ``specdec serve`` process, for the server bench.

Put this folder on ``PYTHONPATH`` and name a log file in ``SPECDEC_AUTO_LOG``; the bench's servers (subprocesses that
inherit both) then append one line per measured trial round and one per decision:

    PYTHONPATH=benchmarks/auto_trials SPECDEC_AUTO_LOG=trials.log OMP_NUM_THREADS=1 \\
        specdec bench --serve --speculate off on auto --compile on --num-prompts 12 --repeats 3 --no-progress --no-plots

A round's line: the batch-size bucket, the width measured (None: uncapped, 0: plain), the batch's rows, the tokens it
committed, its seconds as ``Crossover`` counts them (the prefill of joining rows left out), the decoding thread's CPU
seconds over the round (``time.thread_time``: not counting waits for the GIL or for a core, counting the prefill) and
the seconds left out. A decision's line starts with ``#``. Findings: docs/journal/2026-11-29-auto-trials-3-4-rows.md,
"``auto``'s trials at 3-4
rows, and a drafter shorter than its target".
"""

import os
import sys
import time

if os.environ.get("SPECDEC_AUTO_LOG") and "serve" in sys.argv:
    from specdec import schedules

    _log = open(os.environ["SPECDEC_AUTO_LOG"], "a")  # noqa: SIM115 - open for the process's life
    _plan, _close = schedules.Crossover.plan, schedules.Crossover._close

    def plan(self, rows, device):
        out = _plan(self, rows, device)
        if self._open is not None:  # a measured round starts
            self._logged = (rows, time.thread_time())
        return out

    def close(self):
        if self._open is not None and self._tokens is not None:
            bucket, width, started = self._open
            rows, cpu = self._logged
            seconds = self.clock() - started - self._left_out
            _log.write(f"{bucket} {width} {rows} {self._tokens} {seconds:.6f} {time.thread_time() - cpu:.6f} "
                       f"{self._left_out:.6f}\n")
        decided = set(self.width.items())
        _close(self)
        for bucket, width in sorted(set(self.width.items()) - decided, key=str):
            _log.write(f"# bucket {bucket} keeps width {width}; tokens/s "
                       f"{schedules._speeds(self._trials.get(bucket, {}))}\n")
        _log.flush()

    schedules.Crossover.plan, schedules.Crossover._close = plan, close
