"""Where a conversion's time goes, for its progress bar: seconds of reading, calibration, quantizing and writing,
summed over the threads that do them, shown as shares ("read 9% calibrate 31% quantize 52% write 8%")."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

KINDS = ("read", "calibrate", "quantize", "write")


class TimeShares:
    """Thread-safe sums of busy seconds per kind (KINDS)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.seconds = dict.fromkeys(KINDS, 0.0)

    def add(self, kind: str, seconds: float) -> None:
        with self._lock:
            self.seconds[kind] += seconds

    @contextmanager
    def timing(self, kind: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(kind, time.perf_counter() - t)

    def postfix(self) -> str:
        """"read 9% quantize 83% write 8%" (kinds with no time left out; "" before any)."""
        with self._lock:
            total = sum(self.seconds.values())
            if total <= 0:
                return ""
            return " ".join(f"{k} {100 * v / total:.0f}%" for k, v in self.seconds.items() if v > 0)
