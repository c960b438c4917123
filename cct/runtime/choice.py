"""Choosing between ways of running the same work by measuring them (the
"auto" schedule): candidates take turns, the first run of each is a warm-up
(buffers, schedules being built) and not counted, and once each has `runs`
counted runs the one with the lowest median is kept."""
import logging
import statistics

log = logging.getLogger("cct.runtime.choice")

RUNS = 3


class FasterOf:
    def __init__(self, candidates, what, runs=RUNS):
        self.what = what                       # names the choice in the log line
        self.runs = runs
        self.times = {candidate: [] for candidate in candidates}
        self.warmed = set()
        self.chosen = None

    def next(self):
        """The candidate to run now: the chosen one, else a cold one, else the least measured."""
        if self.chosen is not None:
            return self.chosen
        return min(self.times, key=lambda candidate: (candidate in self.warmed, len(self.times[candidate])))

    def record(self, candidate, seconds):
        """One run of `candidate` took `seconds` (per unit of work)."""
        if self.chosen is not None:
            return
        if candidate not in self.warmed:
            self.warmed.add(candidate)
            return
        self.times[candidate].append(seconds)
        if min(len(runs) for runs in self.times.values()) >= self.runs:
            medians = {name: statistics.median(runs) for name, runs in self.times.items()}
            self.chosen = min(medians, key=medians.get)
            log.info("%s: %s (%s)", self.what, self.chosen,
                     ", ".join(f"{name} {1e3 * value:.2f} ms" for name, value in medians.items()))
