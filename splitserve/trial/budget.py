"""The trial's wall-clock budget: the same time on any machine, spent in proportion.

A spec's `capacity.budget_s` is the replay time per repeat. It is shared between the launches
still to come (the calibration counts twice: its search has no good starting point); each
launch spends about 60% of its share on the capacity search and 30% on the fixed-rate run.
The fixed-rate run's length follows from the calibration: as many of the plan's requests as
arrive in its share at the measured rate (at least MIN_FIXED_REQUESTS), the same number for
every arrangement. A machine twice as slow measures half the rate, so it replays about half
the requests in the same time instead of taking twice as long.
"""
from __future__ import annotations

import time

SEARCH_SHARE = 0.6
FIXED_SHARE = 0.3
MIN_FIXED_REQUESTS = 8  # fewer says little; the headline is the capacity search anyway


class Budget:
    def __init__(self, seconds_per_repeat: float | None, repeat: int, weight: float,
                 clock=time.monotonic):
        self.total = seconds_per_repeat * repeat if seconds_per_repeat else None
        self.weight_left = weight
        self.clock = clock
        self.started = clock()

    def share(self, weight: float = 1.0) -> float | None:
        """Seconds this launch may spend (None: no budget)."""
        if self.total is None:
            return None
        left = max(self.total - (self.clock() - self.started), 0.0)
        return left * weight / max(self.weight_left, weight)

    def spent(self, weight: float = 1.0) -> None:
        self.weight_left = max(self.weight_left - weight, 0.0)

    @staticmethod
    def fixed_requests(share_s: float | None, rate_rps: float | None, num_planned: int) -> int:
        if share_s is None or not rate_rps:
            return num_planned
        fits = int(FIXED_SHARE * share_s * rate_rps) + 1
        return max(min(MIN_FIXED_REQUESTS, num_planned), min(fits, num_planned))
