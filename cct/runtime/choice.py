"""Choosing between ways of running the same work by measuring them (the
"auto" schedule): candidates take turns, the first run of each is a warm-up
(buffers, schedules being built) and not counted, and once each has `runs`
counted runs the one with the lowest median is kept. Once every candidate
has a counted run, one whose fastest run is CLEARLY_SLOWER than the best
median so far is measured no further: measuring every candidate to the end
spent two thirds of its runs in the slower ones
(BENCHMARKS.md, "Streams and thread control (issues 11 and 12)").

A choice made while the host was busy can be wrong for the rest of a long
run (the first windows of a training run are a few seconds of its hours), so
it is checked again: after every `recheck` runs of the chosen candidate,
each other one runs once; one that took under RECHECK_MARGIN of the chosen's
median over its last RECENT runs starts the measuring afresh. The check's
order is a function of the runs counted only, so every MPI rank, recording
the ranks' slowest times, makes the same choices at the same runs."""
import logging
import statistics
from typing import Dict, Iterable, List, Optional, Set

log = logging.getLogger("cct.runtime.choice")

RUNS = 3
RECHECK = 200           # runs of the chosen candidate between two checks of the others
RECENT = 20             # the chosen's runs its median is taken over
RECHECK_MARGIN = 0.9    # a single run this much faster than that median: measure again
CLEARLY_SLOWER = 1.25   # a fastest run this many times the best median: measured no further


class FasterOf:
    def __init__(self, candidates: Iterable[str], what: str, runs: int = RUNS, recheck: int = RECHECK) -> None:
        self.what = what                       # names the choice in the log line
        self.runs, self.recheck = runs, recheck
        self.times: Dict[str, List[float]] = {candidate: [] for candidate in candidates}
        self.warmed: Set[str] = set()
        self.chosen: Optional[str] = None
        self._recent: List[float] = []         # the chosen's last RECENT times
        self._since = 0                        # the chosen's runs since the last check
        self._checking: List[str] = []         # the others still to run once in this check
        self._challengers: Dict[str, float] = {}   # their times in this check

    def next(self) -> str:
        """The candidate to run now: while measuring, a cold one, else the
        least measured; once chosen, the chosen one, but during a check
        each other one once."""
        if self.chosen is not None:
            return self._checking[0] if self._checking else self.chosen
        return min(self._contenders(), key=lambda candidate: (candidate in self.warmed, len(self.times[candidate])))

    def _contenders(self) -> List[str]:
        """The candidates still measured: all until each has a counted run,
        then those whose fastest run is within CLEARLY_SLOWER of the best
        median (the best one always is). A choice a busy moment got wrong
        this way is found again by the checks."""
        if not all(self.times.values()):
            return list(self.times)
        best = min(statistics.median(runs) for runs in self.times.values())
        return [name for name, runs in self.times.items() if min(runs) <= CLEARLY_SLOWER * best]

    def record(self, candidate: str, seconds: float) -> None:
        """One run of `candidate` took `seconds` (per unit of work)."""
        if self.chosen is not None:
            self._record_chosen(candidate, seconds)
            return
        if candidate not in self.warmed:
            self.warmed.add(candidate)
            return
        self.times[candidate].append(seconds)
        if not all(self.times.values()):
            return
        contenders = self._contenders()
        if min(len(self.times[name]) for name in contenders) >= self.runs:
            medians = {name: statistics.median(runs) for name, runs in self.times.items()}
            self.chosen = min(contenders, key=medians.__getitem__)
            self._recent = [medians[self.chosen]]
            log.info("%s: %s (%s)", self.what, self.chosen,
                     ", ".join(f"{name} {1e3 * value:.2f} ms" for name, value in medians.items()))

    def _record_chosen(self, candidate: str, seconds: float) -> None:
        if self._checking and candidate == self._checking[0]:
            self._challengers[self._checking.pop(0)] = seconds
            if not self._checking:
                self._judge()
            return
        if candidate != self.chosen:
            return
        self._recent = (self._recent + [seconds])[-RECENT:]
        self._since += 1
        if self._since >= self.recheck and len(self.times) > 1:
            self._since = 0
            self._checking = [name for name in self.times if name != self.chosen]
            self._challengers = {}

    def _judge(self) -> None:
        """End of a check: measure every candidate afresh if one ran faster
        than the chosen's recent median by the margin."""
        typical = statistics.median(self._recent)
        fastest = min(self._challengers, key=self._challengers.__getitem__)
        if self._challengers[fastest] < RECHECK_MARGIN * typical:
            log.info("%s: %s ran in %.2f ms against %s's %.2f ms: measuring again", self.what, fastest,
                     1e3 * self._challengers[fastest], self.chosen, 1e3 * typical)
            self.chosen = None
            self.times = {name: [] for name in self.times}      # every candidate is warm already
