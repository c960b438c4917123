"""The solver's schedule windows: in the streams, tuned and auto schedules
Solver.step runs runs of iterations as one graph of sub-tasks
(cct.runtime.scheduler), each window ending where Caffe's loop displays,
tests or snapshots; "auto" times windows in each schedule and keeps the
faster. The sub-tasks reach the solver only through SolverUpdates, the
runtime's narrow Updates interface (cct.runtime.graph)."""
import time

from cct.runtime import scheduler, tuner as tuner_module
from cct.runtime import settings as run_config
from cct.runtime.choice import FasterOf

# Iterations the streams schedule runs as one graph at most: the window ends
# in a barrier; a stop request waits for the window's end.
STREAM_WINDOW = 8


class SolverUpdates:
    """What whole-iteration sub-tasks ask of a solver (cct.runtime.graph's
    Updates): its clipping and passes, the MPI gradient sums, iteration k's
    rate, one parameter's update, and how many iterations ran, counted from
    the solver's iteration when the window starts (start())."""

    def __init__(self, solver):
        self._solver = solver
        self._first = solver.iter
        self.clips = solver.param.clip_gradients >= 0
        self.passes = solver.param.iter_size
        gradient_sum = solver.gradient_sum
        self.sums = gradient_sum.unit_params() if gradient_sum is not None else ()

    def start(self):
        self._first = self._solver.iter

    def sum_gradients(self, unit):
        self._solver.gradient_sum.sum_unit(unit)

    def begin(self, iteration):
        self._solver.iter = self._first + iteration
        self._solver.begin_update(log_rate=False)

    def update(self, param, stripes):
        self._solver.update_param(param, stripes=stripes)

    def finish(self, iterations):
        self._solver.iter = self._first + iterations


class ScheduleWindows:
    """Solver's windows of iterations (a mixin: it reads the solver's loop
    state, the net, the MPI world and the iteration's own steps)."""

    def _window_mode(self):
        """How the next iterations run: None, one iteration in the executor's
        own schedule; "streams", a window of iterations as one graph on the
        streams (each of iter_size passes in it); with the "auto" schedule,
        "sequential" or "streams" as measured on this net and shape
        (cct.runtime.choice). Only where nothing must see one iteration at a
        time (pycaffe callbacks, per-layer subscribers, debug_info), and not on
        an OpenCL device, whose one in-order queue runs the layers in turn.
        Over MPI (where MPI allows calls from every thread) every rank runs
        the window alike (its gradient sums are sub-tasks there, the overlap
        thread's collectives here): the auto choice is made from every
        rank's slowest times (_window_in)."""
        executor, param = self.net.executor, self.param
        executor.fit_threads()                  # the window's schedule is chosen for the cores free now
        if (executor.schedule == "sequential" or self._watched() or param.debug_info
                or run_config.device() is not None or (self.world is not None and not self.world.threads_allowed)):
            return None
        if executor.schedule in ("streams", "tuned"):
            return executor.schedule
        key = self.net.executor.shape_key()
        if key not in self._auto:
            self._auto[key] = FasterOf(("sequential", "streams", "tuned"), "schedule auto (time per iteration)")
        return self._auto[key].next()

    def auto_choice(self):
        """The schedule the "auto" schedule keeps for the net's shapes now:
        "sequential", "streams" or "tuned"; None while it still measures them
        (its first dozen iterations or so), or where the schedule is not auto."""
        choice = self._auto.get(self.net.executor.shape_key())
        return None if choice is None else choice.chosen

    def _watched(self):
        """Whether something must see one iteration, or one layer, at a time: a
        pycaffe callback or a per-layer subscriber other than the MPI
        gradient sums' own (which are sub-tasks on the streams)."""
        ours = self.gradient_sum
        callbacks = [pair for pair in self.callbacks if ours is None or pair[0] != ours.on_start]
        listeners = [callback for callback in self.net.executor.listeners()
                     if ours is None or callback != ours.after_backward]
        return bool(callbacks or listeners)

    def _window_in(self, mode, count):
        """`count` iterations in `mode`; under "auto", timed for its choice."""
        executor = self.net.executor
        chosen_by = executor.schedule
        start = time.perf_counter()
        if mode == "streams":
            self._iterations_on_streams(count)
        elif mode == "tuned":
            self._iterations_tuned(count)
        else:
            executor.schedule = "sequential"
            try:
                for _ in range(count):
                    self._iteration()
            finally:
                executor.schedule = chosen_by
        if chosen_by == "auto":
            seconds = (time.perf_counter() - start) / count
            if self.world is not None:        # the same choice on every rank
                seconds = self.world.slowest(seconds)
            self._auto[self.net.executor.shape_key()].record(mode, seconds)

    def _window(self, stop_iter):
        """How many iterations from self.iter run as one graph: up to the next
        display iteration (included), snapshot, test or the end."""
        param, start = self.param, self.iter
        end = min(stop_iter, start + STREAM_WINDOW)
        if param.display:
            end = min(end, start + (-start) % param.display + 1)
        for every in (param.snapshot, param.test_interval):
            if every:
                end = min(end, (start // every + 1) * every)
        return end - start

    def _iterations_on_streams(self, count):
        """`count` iterations as one graph on the streams: the weight gradients
        of one iteration overlap the next one's forward where the edges allow
        (the same numbers as _iteration's, bitwise)."""
        first = self.iter
        if self.gradient_sum is not None:
            self.gradient_sum.on_window()
        runner = scheduler.run_on_streams(self._stream_schedule(count))
        self._count_iterations([runner.loss(k) for k in range(count)], first)

    def _count_iterations(self, losses, first):
        """The solver's books after graph.Runners ran a window of iterations
        from iteration `first`, of these losses (the runners have moved
        self.iter past them); over MPI, the losses are the ranks' means and a
        request reaches every rank at the window's end (once a window on
        every rank, however each ran it)."""
        count = len(losses)
        if self.world is not None:
            losses, self._agreed = self.world.agree(losses, self._take_request())
        for k in range(count):
            self.iter = first + k
            self._update_smoothed_loss(losses[k], self._start_iter)
        if self._display():                 # the window's last iteration
            self._log_rate()
        self.iter = first + count

    def _iterations_tuned(self, count):
        """The "tuned" schedule (cct.runtime.tuner): the net's first
        iterations profile each sub-task's thread counts, one iteration at a
        time; then windows on the streams with those counts and co-running."""
        tuner = self._tuner()
        if self.gradient_sum is not None:
            self.gradient_sum.on_window()
        first, losses = self.iter, []
        while count and not tuner.done:
            losses.append(tuner.profile_step().loss(0))
            count -= 1
        if count:
            schedule = self._stream_schedule(count, tuned=True)
            if schedule.tuner is not tuner:
                schedule.tune(tuner)
            runner = scheduler.run_on_streams(schedule)
            losses += [runner.loss(k) for k in range(count)]
        self._count_iterations(losses, first)

    def _tuner(self):
        """The profile of the net's current shapes and partitions."""
        key = self.net.executor.shape_key()
        if key not in self._tuners:
            schedule = self._stream_schedule(1)
            self._tuners[key] = tuner_module.Tuner(schedule, cache=tuner_module.cache_path(self.net, schedule.steps))
        return self._tuners[key]

    def _stream_schedule(self, count, tuned=False):
        """The Schedule of `count` iterations for the net's current shapes and
        partitions (built once for each, and once more for the tuned schedule)."""
        net = self.net
        key = (count, tuned) + self.net.executor.shape_key()
        if key not in self._stream_schedules:
            self._stream_schedules[key] = scheduler.Schedule(
                net, net.executor.steps(), updates=SolverUpdates(self), iterations=count, **run_config.priorities())
        return self._stream_schedules[key]

