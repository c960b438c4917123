"""The solver: Caffe's Solver, with pycaffe's surface: the training loop,
test passes, display, and the update's template method. The six update rules
are its subclasses (cct.training.updates); snapshots and restore live in
cct.training.snapshot.

The update is a template method (Caffe's sgd_solver.cpp):

    step(iters), per iteration:
        clear param diffs -> iter_size x forward_backward (loss averaged)
        -> smoothed loss over `average_loss` iterations -> display
        -> apply_update():
             learning rate (cct.training.lr_policy) -> clip_gradients (global L2 norm)
             -> per learnable param: normalize (1 / iter_size)
                                     -> regularize (L2 or L1, weight_decay * decay_mult)
                                     -> compute_update_value (the subclass's rule)
             -> param.data -= param.diff
        -> iter += 1 -> snapshot / stop on schedule or request

In the streams schedule (cct.runtime.scheduler) the same steps run as
sub-tasks: the learning rate and clipping once per iteration (begin_update),
then normalize -> regularize -> compute_update_value -> apply per parameter
(update_param), several iterations at once, to the same numbers.

Subclasses override only compute_update_value. Histories are float32 blobs
laid out as Caffe's history_ (AdaDelta and Adam append a second set), so a
.solverstate written here restores in Caffe and the other way around.

In a device run (cct.runtime.settings: gpu mode) the update runs on the
device, as Caffe's GPU mode does (update_on): the gradients are cleared by a
device fill, each parameter's whole step is one kernel (Device.solver_step,
the host's passes in their order: the same numbers), clip_gradients' norm is
summed there and read as one scalar, so parameters, gradients and history
stay on the device and no byte of them crosses after the first iteration.
Host runs, MPI runs and solvers with a rule or pass of their own keep the
host update.
"""
import logging
import math
import os
import threading
import time

import numpy as np

from cct.core.allocation import charging
from cct.core.blob import Blob
from cct.core.errors import ConfigError
from cct.core.rng import set_random_seed
from cct.formats.prototxt import read_solver
from cct.formats.upgrade import upgrade_solver
from cct.proto import caffe_pb2
from cct.runtime import memory, memory_plan
from cct.runtime import settings as run_config
from cct.runtime.threads import run_all
from cct.training import distributed, nets, snapshot
from cct.training.windows import ScheduleWindows
from cct.training.lr_policy import check_policy, learning_rate

log = logging.getLogger("cct.training.solver")

SOLVER_TYPES = {}            # SolverParameter.type -> Solver subclass
UPDATE_PIECE = 1 << 16       # elements per piece of the update's element-wise passes
# Learnable elements (all parameters together) below which the update runs on one thread: OpenBLAS's pool thread,
# still spinning after the backward, costs a small update more than a second thread saves
# (BENCHMARKS.md, "Behind cct/training/solver.py").
STRIPED_UPDATE_ELEMENTS = 1 << 21
ACTIONS = ("none", "stop", "snapshot")


def register_solver(type_name):
    def add(cls):
        cls.type = type_name
        SOLVER_TYPES[type_name] = cls
        return cls
    return add


def load_solver_param(path):
    """A SolverParameter from a prototxt file, upgraded as Caffe's
    ReadSolverParamsFromTextFileOrDie does (solver_type enum -> type; a missing
    snapshot_prefix becomes the solver file's path without extension, a folder
    prefix gets the solver file's stem appended)."""
    path = os.fspath(path)
    param = upgrade_solver(read_solver(path), source=path)
    if not param.HasField("snapshot_prefix"):
        param.snapshot_prefix = os.path.splitext(path)[0]
    elif os.path.isdir(param.snapshot_prefix):
        stem = os.path.splitext(os.path.basename(path))[0]
        param.snapshot_prefix = os.path.join(param.snapshot_prefix, stem)
    return param


def get_solver(solver, source=None, share_diffs=False):
    """A solver of the type the SolverParameter (or solver prototxt path) names.
    share_diffs: whether its train net shares activation diffs (cct.runtime.memory)
    when neither CCT_SHARE_DIFFS nor the run configuration says."""
    param, source = _solver_param(solver, source)
    cls = SOLVER_TYPES.get(param.type)
    if cls is None:
        raise ConfigError(f"{source}: type: unknown solver type {param.type!r}; "
                          f"known types: {', '.join(sorted(SOLVER_TYPES))}")
    return cls(param, source=source, share_diffs=share_diffs)


def _solver_param(solver, source):
    if isinstance(solver, caffe_pb2.SolverParameter):
        return upgrade_solver(solver, source or "<SolverParameter>"), source or "<SolverParameter>"
    return load_solver_param(solver), source or os.fspath(solver)


def _fmt(value):
    """Numbers as Caffe's iostreams print them: 6 significant digits."""
    return f"{value:.6g}"


class Solver(ScheduleWindows):
    """Base solver: the training loop, testing, snapshots. `Solver(path or
    SolverParameter)`; pycaffe's caffe.SGDSolver(path) etc. are the subclasses."""

    type = None
    device_rule = None               # the rule's name for Device.solver_step (the six rules set it)
    device_update = True             # False: a device run's update on the host (tests compare the two)

    def __init__(self, solver, source=None, share_diffs=False):
        param, source = _solver_param(solver, source)
        if param.type != self.type and param.HasField("type"):
            log.warning("%s: type %r given, running it with the %s solver", source, param.type, self.type)
        self.param = param
        self.source = source
        self.iter = 0
        self.current_step = 0
        self.callbacks = []
        self.mean_scores = []
        self.smoothed_loss = 0.0
        self._losses = []
        self._requested = "none"
        self._early_exit = False
        self.world = distributed.world()      # None in a single process
        self.gradient_sum = None               # distributed.GradientSum, set by distributed.join
        self._agreed = "none"                  # the ranks' agreed request (World.agree)
        self._check_param()
        if param.random_seed >= 0:
            set_random_seed(param.random_seed + self.rank)     # per rank, as Caffe's Solver::Init
        with charging(f"solver {source}") as charge:       # the nets together against the limit
            self.net = nets.train_net(param, source)
            if run_config.share_diffs_enabled(default=share_diffs):
                # activation diffs then hold no meaning after backward: pycaffe opts in
                log.info("Sharing the train net's diffs: %s", memory.share_diffs(self.net))
            # as Caffe's: only the root solver tests (and so reads the test sources)
            self.test_nets = nets.test_nets(param, source) if self.is_root else []
            self.mean_scores = [[] for _ in self.test_nets]
        for net in [self.net] + self.test_nets:
            if self.is_root:           # the other ranks get rank 0's weights (distributed.join)
                nets.load_weights(param, net)
        for net in self.test_nets:       # as every test does: their own parameter stores are freed now
            self.share_weights(net)
        self._images_per_iter = nets.batch_size(self.net) * param.iter_size * self.size
        self.history_blobs = [Blob(p.shape, p.dtype) for p in self.net.learnable_params]
        self._stream_schedules = {}  # (iterations, tuned, shapes, partitions) -> scheduler.Schedule
        self._tuners = {}            # (shapes, partitions) -> tuner.Tuner, the "tuned" schedule's profile
        self._auto = {}              # (shapes, partitions) -> FasterOf, the "auto" schedule's choice
        self._work = {}              # (dtype, stripe, thread) -> work arrays of UPDATE_PIECE elements (_pieces)
        self._stripe = threading.local()     # which pieces this thread updates (_striped)
        self.pre_solve()
        if self.world is not None:
            distributed.join(self, self.world)
        # before the first iteration touches what setup mapped (cct.runtime.memory_plan)
        self.memory_plan = memory_plan.training_plan(self.net, self.test_nets, self.history, charge.in_use)
        log.info("Memory plan: %s", self.memory_plan)
        self.memory_plan.check(f"solver {source}")
        log.info("Solver scaffolding done.")

    # --- set-up ------------------------------------------------------------------
    def _check_param(self):
        param, source = self.param, self.source
        if param.average_loss < 1:
            raise ConfigError(f"{source}: average_loss: must be >= 1, got {param.average_loss}")
        if param.iter_size < 1:
            raise ConfigError(f"{source}: iter_size: must be >= 1, got {param.iter_size}")
        if param.regularization_type not in ("L1", "L2"):
            raise ConfigError(f"{source}: regularization_type: unknown regularization type "
                              f"{param.regularization_type!r}; known: L1, L2")
        check_policy(param, source)
        if param.snapshot < 0:
            raise ConfigError(f"{source}: snapshot: must be >= 0, got {param.snapshot}")
        if param.snapshot and self.is_root:       # only rank 0 writes them (and probes the folder)
            self._check_snapshot_writable()

    def _check_snapshot_writable(self):
        if not self.param.snapshot_prefix:
            raise ConfigError(f"{self.source}: snapshot_prefix: snapshot is {self.param.snapshot} "
                              "but no snapshot_prefix is given")
        probe = snapshot.filename(self, ".tempfile")
        try:
            with open(probe, "w"):
                pass
            os.remove(probe)
        except OSError as error:
            raise ConfigError(f"{self.source}: snapshot_prefix: cannot write to "
                              f"'{self.param.snapshot_prefix}' ({error.strerror}); make sure the "
                              "folder exists and is writable") from None

    def pre_solve(self):
        """Subclass hook: check the solver's own fields, add history entries."""

    @property
    def history(self):
        """The history as host arrays (writable views: the host is current
        after; snapshot, restore and the host update read them)."""
        return [blob.data for blob in self.history_blobs]

    def history_data(self, index):
        """History entry `index` as a writable host array."""
        return self.history_blobs[index].data

    @property
    def rank(self):
        """This solver's rank among the MPI processes training together (0 alone)."""
        return 0 if self.world is None else self.world.rank

    @property
    def size(self):
        """The number of solvers training together (pycaffe's solver_count)."""
        return 1 if self.world is None else self.world.size

    @property
    def is_root(self):
        """Whether this solver displays, tests and snapshots (rank 0; Caffe's root_solver)."""
        return self.rank == 0

    # --- pycaffe's surface -------------------------------------------------------
    def add_callback(self, on_start, on_gradients_ready=None):
        """Call on_start() before each iteration's forward and
        on_gradients_ready() before its update (pycaffe's add_callback). The
        one-argument form is pycaffe's add_callback(nccl): an object with
        on_start and on_gradients_ready methods (Caffe's Solver::Callback)."""
        if on_gradients_ready is None:
            callback = on_start
            if not (callable(getattr(callback, "on_start", None))
                    and callable(getattr(callback, "on_gradients_ready", None))):
                raise TypeError(f"add_callback: {type(callback).__name__} is not a solver callback: give "
                                "on_start and on_gradients_ready, or an object with those methods")
            on_start, on_gradients_ready = callback.on_start, callback.on_gradients_ready
        self.callbacks.append((on_start, on_gradients_ready))

    def close(self):
        """Close the train and test nets (Net.close) and the gradient sums over
        MPI ranks; `with solver:` does it at the end."""
        for net in [self.net] + list(self.test_nets):
            net.close()
        if self.gradient_sum is not None:
            self.gradient_sum.close()
            self.gradient_sum = None

    def __enter__(self):
        return self

    def __exit__(self, *exception):
        self.close()

    def share_weights(self, net):
        """Make `net` use this solver's train-net parameters."""
        net.share_with(self.net)

    def request_action(self, action):
        """Ask the running loop to 'stop', 'snapshot' or do nothing ('none');
        read once, at the end of the current iteration (or test batch)."""
        action = str(action).lower()
        if action not in ACTIONS:
            raise ConfigError(f"request_action: unknown action {action!r}; known: {', '.join(ACTIONS)}")
        self._requested = action

    def _take_request(self):
        action, self._requested = self._requested, "none"
        return action

    def _take_agreed(self):
        action, self._agreed = self._agreed, "none"
        return action

    def solve(self, resume_file=None):
        """Train to max_iter (Caffe's Solver::Solve), optionally resuming."""
        param = self.param
        log.info("Solving %s", self.net.name)
        log.info("Learning Rate Policy: %s", param.lr_policy)
        self._early_exit = False
        if resume_file:
            log.info("Restoring previous solver status from %s", resume_file)
            self.restore(resume_file)
        self.step(param.max_iter - self.iter)
        if param.snapshot_after_train and (not param.snapshot or self.iter % param.snapshot != 0):
            self.snapshot()
        if self._early_exit:
            log.info("Optimization stopped early.")
            return
        # One more forward to show the final loss, and a last test (Caffe does both).
        if self._displays_now():
            self._update_smoothed_loss(self.net._forward(), self._start_iter)
            log.info("Iteration %d, loss = %s", self.iter, _fmt(self.smoothed_loss))
        if param.test_interval and self.iter % param.test_interval == 0:
            self.test_all()
        log.info("Optimization Done.")

    def step(self, iters):
        """Run `iters` iterations (Caffe's Solver::Step). In the streams
        schedule, runs of up to STREAM_WINDOW iterations go onto the streams
        as one graph (cct.runtime.scheduler), each ending where Caffe's loop
        displays, tests or snapshots; in the auto schedule such windows run
        in both schedules until the faster is known (_window_mode)."""
        param = self.param
        self._start_iter = self.iter
        stop_iter = self.iter + int(iters)
        self._losses = []
        self.smoothed_loss = 0.0
        self._timer = (time.perf_counter(), self.iter)
        while self.iter < stop_iter:
            if (param.test_interval and self.iter % param.test_interval == 0
                    and (self.iter > 0 or param.test_initialization)):
                self.test_all()
                if self._early_exit:
                    break
            mode = self._window_mode()
            if mode is None:
                self._iteration()
            else:
                self._window_in(mode, self._window(stop_iter))
            request = self._take_request() if self.world is None else self._take_agreed()
            if (param.snapshot and self.iter % param.snapshot == 0) or request == "snapshot":
                self.snapshot()
            if request == "stop":
                self._early_exit = True
                break

    def _iteration(self):
        """One iteration layer after layer (the backward in the executor's schedule)."""
        param, net = self.param, self.net
        net.clear_param_diffs()
        for on_start, _ in self.callbacks:
            on_start()
        loss = 0.0
        for _ in range(param.iter_size):
            loss += net.forward_backward()
        loss /= param.iter_size
        if self.world is not None:
            # the displayed loss is the ranks' mean; a request reaches every rank at this iteration
            (loss,), self._agreed = self.world.agree([loss], self._take_request())
        self._update_smoothed_loss(loss, self._start_iter)
        self._display()
        for _, on_gradients_ready in self.callbacks:
            on_gradients_ready()
        self.apply_update()
        self.iter += 1         # counts the updates applied so far

    def _displays_now(self):
        """Whether this iteration shows the display lines (rank 0 only, as Caffe's root solver)."""
        display = self.param.display
        return bool(display) and self.iter % display == 0 and self.is_root

    def _display(self):
        """The display lines, on display iterations; returns whether it showed them."""
        if not self._displays_now():
            return False
        now = time.perf_counter()
        self._log_display(now - self._timer[0], self.iter - self._timer[1])
        self._timer = (now, self.iter)
        if self.param.debug_info:
            self._log_debug_info()
        return True

    def _update_smoothed_loss(self, loss, start_iter):
        average = self.param.average_loss
        if len(self._losses) < average:
            self._losses.append(loss)
            self.smoothed_loss += (loss - self.smoothed_loss) / len(self._losses)
        else:
            index = (self.iter - start_iter) % average
            self.smoothed_loss += (loss - self._losses[index]) / average
            self._losses[index] = loss

    def _log_display(self, lapse, iterations):
        param = self.param
        per_s = iterations / lapse if lapse > 0 else 0.0
        remaining = param.max_iter - self.iter
        eta = ""
        if per_s > 0 and remaining > 0:
            eta = f", ETA {_duration(remaining / per_s)}"
        log.info("Iteration %d (%s iter/s, %s images/s, %ss/%d iters%s), loss = %s",
                 self.iter, _fmt(per_s), _fmt(per_s * self._images_per_iter), _fmt(lapse),
                 param.display, eta, _fmt(self.smoothed_loss))
        self._log_outputs(self.net, "Train", [self.net.blobs[n].read_data().ravel() for n in self.net.outputs])

    @staticmethod
    def _log_outputs(net, kind, values_per_output):
        index = 0
        for name, values in zip(net.outputs, values_per_output):
            weight = net.blob_loss_weights.get(name, 0.0)
            for value in np.asarray(values).ravel():
                suffix = f" (* {_fmt(weight)} = {_fmt(weight * value)} loss)" if weight else ""
                log.info("    %s net output #%d: %s = %s%s", kind, index, name, _fmt(value), suffix)
                index += 1

    def _log_debug_info(self):
        """Mean absolute values of every top and param gradient (Caffe's debug_info)."""
        net = self.net
        for layer, tops, top_names in zip(net.layers, net.top_vecs, net.top_names.values()):
            for blob, name in zip(tops, top_names):
                log.info("    [Forward] Layer %s, top blob %s data: %s", layer.name, name,
                         _fmt(float(np.abs(blob.read_data()).mean()) if blob.count else 0.0))
            for index, blob in enumerate(layer.blobs):
                log.info("    [Backward] Layer %s, param blob %d diff: %s", layer.name, index,
                         _fmt(float(np.abs(blob.read_diff()).mean()) if blob.count else 0.0))

    # --- testing -----------------------------------------------------------------
    def test_all(self):
        for index in range(len(self.test_nets)):
            if self._early_exit:
                break
            self.test(index)

    def test(self, test_net_id=0):
        """Run test net `test_net_id` for its test_iter batches; log and return the
        mean of every output element (Caffe's Solver::Test)."""
        param = self.param
        log.info("Iteration %d, Testing net (#%d)", self.iter, test_net_id)
        net = self.test_nets[test_net_id]
        net.share_with(self.net)
        iterations = param.test_iter[test_net_id]
        scores, loss = None, 0.0
        for _ in range(iterations):
            # several ranks: a request waits for the next iteration, where every rank agrees on it
            request = self._take_request() if self.world is None else "none"
            if request == "snapshot":
                self.snapshot()
            elif request == "stop":
                self._early_exit = True
            if self._early_exit:
                log.info("Test interrupted.")
                return None
            batch_loss = net._forward()
            if param.test_compute_loss:
                loss += batch_loss
            values = np.concatenate([net.blobs[n].read_data().ravel() for n in net.outputs]
                                    or [np.zeros(0)]).astype(np.float64)
            scores = values if scores is None else scores + values
        if param.test_compute_loss and iterations:
            log.info("Test loss: %s", _fmt(loss / iterations))
        means = scores / iterations if scores is not None else np.zeros(0)
        split = np.cumsum([net.blobs[n].count for n in net.outputs])[:-1]
        self._log_outputs(net, "Test", np.split(means, split) if len(net.outputs) else [])
        self.mean_scores[test_net_id] = list(means)
        return list(means)

    # --- the update --------------------------------------------------------------
    def get_learning_rate(self):
        rate, self.current_step = learning_rate(self.param, self.iter, self.current_step, self.source)
        return rate

    def apply_update(self):
        """One parameter update from the gradients in the net's param diffs:
        on the device that holds them in a device run (update_on), else on the host."""
        device = self._update_device()
        if device is not None:
            self.update_on(device)
            return
        self._params_to_host()
        self.begin_update()
        elements = sum(blob.count for blob in self.net.learnable_params)
        self._striped(self._update_params, self._rate, stripes=None if elements >= STRIPED_UPDATE_ELEMENTS else 1)

    def _params_to_host(self):
        """Make the host current for every parameter, gradient and history
        entry here, on the calling thread, before the update's threads read
        them: each copied down once (where a device is ahead), none by two
        threads at once."""
        for blob in self.net.learnable_params + self.history_blobs:
            blob.host_current()

    def _update_device(self):
        """The device the update runs on: a device run's, unless
        device_update is off, the solver's rule is its own (no device_rule,
        or a subclass overrides a pass) or MPI sums the gradients on the host."""
        if not self.device_update or self.gradient_sum is not None or self._device_rule() is None:
            return None
        return self.net.executor.device()

    def _device_rule(self):
        """The registered rule's name where this solver runs that rule's passes unchanged, else None."""
        cls = type(self)
        registered = SOLVER_TYPES.get(cls.type)
        if registered is None or registered.device_rule is None:
            return None
        passes = ("compute_update_value", "normalize", "regularize", "clip_gradients", "_apply_step",
                  "_update_param")
        if any(getattr(cls, name) is not getattr(registered, name) for name in passes):
            return None
        return registered.device_rule

    def update_on(self, device):
        """The update on `device`, one kernel per parameter (Device.solver_step)."""
        self._rate = self.get_learning_rate()
        if self._displays_now():
            self._log_rate()
        clip = self._clip_scale_on(device)
        params, rule = self.net.learnable_params, self._device_rule()
        for index, blob in enumerate(params):
            decay = self.param.weight_decay * self.net.params_weight_decay[index]
            regularization = 0 if not decay else 1 if self.param.regularization_type == "L2" else 2
            histories = [h.mutable_device_data(device) for h in self.history_blobs[index::len(params)]]
            rate, coefficients = self.step_scalars(index, self._rate)
            device.solver_step(rule, blob.count, blob.mutable_device_data(device), blob.mutable_device_diff(device),
                               histories[0], histories[1] if len(histories) > 1 else None, clip,
                               1.0 / self.param.iter_size, regularization, decay, rate, coefficients)

    def step_scalars(self, index, rate):
        """(rate, coefficients) of parameter `index`'s Device.solver_step (kernels/update.cl)."""
        raise NotImplementedError

    def _clip_scale_on(self, device):
        """clip_gradients' scale on a device: the norm summed there, one scalar read."""
        clip = self.param.clip_gradients
        if clip < 0:
            return 1.0
        params = self.net.learnable_params
        norm = math.sqrt(device.sum_of_squares([(p.device_diff(device), p.count) for p in params]))
        return self._clip_scale(norm, clip)

    def _clip_scale(self, norm, clip):
        """The factor clip_gradients scales the gradients by (1: none; a NaN norm clips nothing, as Caffe's)."""
        if not norm > clip:
            return 1.0
        scale = clip / norm
        log.info("Gradient clipping: scaling down gradients (L2 norm %s > %s) by scale factor %s",
                 _fmt(norm), _fmt(clip), _fmt(scale))
        return scale

    def begin_update(self, log_rate=True):
        """What the update does once before any parameter's: the learning rate
        (logged on display iterations) and clip_gradients, which needs every
        gradient (a barrier for the streams schedule)."""
        self._rate = self.get_learning_rate()
        if log_rate and self._displays_now():
            self._log_rate()
        self.clip_gradients()

    def _log_rate(self):
        log.info("Iteration %d, lr = %s", self.iter, _fmt(self._rate))

    def update_param(self, index, stripes=1):
        """Learnable parameter `index`'s part of the update begun by
        begin_update (a sub-task of the streams schedule, cct.runtime.graph),
        on `stripes` threads (the same numbers: see _striped)."""
        self._await_sum(index)
        if stripes > 1:
            self._striped(self._update_param, index, self._rate, stripes=stripes)
        else:
            self._update_param(index, self._rate)

    def _update_params(self, rate):
        if self.gradient_sum is None:
            order = range(len(self.net.learnable_params))
        else:        # each parameter once its sum over the ranks is in, the first summed first
            order = self.gradient_sum.summed_order(timed=self._on_first_stripe())
        for index in order:
            self._update_param(index, rate)

    def _on_first_stripe(self):
        """Whether this thread updates the first stripe (or all) of the parameters (_striped)."""
        return getattr(self._stripe, "value", (0, 1))[0] == 0

    def _await_sum(self, index):
        """Until parameter `index`'s gradient is summed over the ranks (it may
        still be on its way: distributed.GradientSum); timed on one stripe."""
        if self.gradient_sum is not None:
            self.gradient_sum.wait(index, timed=self._on_first_stripe())

    def _update_param(self, index, rate):
        # element-wise, each parameter on its own: parameter by parameter gives
        # the numbers of Caffe's all-normalize-then-all-apply order
        self.normalize(index)
        self.regularize(index)
        self.compute_update_value(index, rate)
        self._apply_step(self.net.learnable_params[index])

    def _apply_step(self, blob):
        for data, diff in self._pieces(blob.data, blob.diff, temps=0):
            data -= diff                           # Caffe's Blob::Update

    def _striped(self, function, *args, stripes=None):
        """Run function(*args) on the executor's threads at once, thread k doing
        the pieces k, k + T, k + 2T, ... of every parameter (_pieces): the update
        is element-wise, so each element gets the same operations in the same
        order, and the numbers are those of one thread. So an update rule must
        go through _pieces for every array it touches (all of cct's do): a rule
        working on whole arrays would be applied once per thread. numpy releases the GIL
        in each piece's passes (CaffeNet's 61M parameters: 4 passes of 233 MB)."""
        executor = self.net.executor
        if stripes is None:
            stripes = max(1, min(executor.threads, 8))      # memory-bound: more threads add nothing
        workers = executor.workers(stripes)

        def run(stripe):
            self._stripe.value = (stripe, stripes)
            try:
                function(*args)
            finally:
                self._stripe.value = (0, 1)
        # every stripe has finished (or failed) before this returns: a snapshot
        # after a failed update must not race a stripe still writing weights
        run_all(workers, run, [(stripe,) for stripe in range(stripes)])

    def clip_gradients(self):
        clip = self.param.clip_gradients
        if clip < 0:
            return
        if self.gradient_sum is not None:       # the norm is of the summed gradients
            self.gradient_sum.wait()
        params = self.net.learnable_params
        norm = float(np.sqrt(sum(float(np.dot(p.diff.ravel(), p.diff.ravel())) for p in params)))
        scale = self._clip_scale(norm, clip)
        if scale != 1.0:
            for p in params:
                p.diff[...] *= scale

    def normalize(self, index):
        """Average the gradient accumulated over iter_size passes."""
        if self.param.iter_size != 1:
            for diff, in self._pieces(self.net.learnable_params[index].diff, temps=0):
                diff *= 1.0 / self.param.iter_size

    def regularize(self, index):
        decay = self.param.weight_decay * self.net.params_weight_decay[index]
        if not decay:
            return
        blob = self.net.learnable_params[index]
        l2 = self.param.regularization_type == "L2"
        for data, diff, temp in self._pieces(blob.data, blob.diff):
            if l2:
                np.multiply(data, decay, out=temp)
            else:
                np.sign(data, out=temp)
                temp *= decay
            diff += temp

    def _pieces(self, *arrays, temps=1):
        """The arrays (same size) flattened and cut into UPDATE_PIECE-element
        pieces, each yielded with `temps` work arrays of the piece's length: the
        update's temporaries stay small (a parameter-sized one would hold 244 MB
        for CaffeNet) and each piece's passes run in the CPU cache. Under
        _striped, only this thread's pieces."""
        flats = [array.reshape(-1) for array in arrays]
        size, dtype = flats[0].size, flats[0].dtype
        stripe, stripes = getattr(self._stripe, "value", (0, 1))
        key = (dtype, stripe, threading.get_ident())     # streams update two parameters at once
        work = self._work.get(key)
        if work is None or len(work) < temps:
            work = self._work[key] = [np.empty(UPDATE_PIECE, dtype) for _ in range(temps)]
        for start in range(stripe * UPDATE_PIECE, size, stripes * UPDATE_PIECE):
            stop = min(start + UPDATE_PIECE, size)
            yield tuple(flat[start:stop] for flat in flats) + tuple(w[:stop - start] for w in work[:temps])

    def compute_update_value(self, index, rate):
        """Turn the param's regularized gradient (diff) into the step to subtract."""
        raise NotImplementedError

    # --- snapshots (cct.training.snapshot) ---------------------------------------------
    def snapshot(self):
        """Write the weights and the solver state; returns the state's path
        (None on a rank other than 0: the weights are rank 0's)."""
        if not self.is_root:
            return None
        return snapshot.write(self)

    def restore(self, state_file):
        """Continue from a .solverstate(.h5): iteration, step counter, history and
        the weights file it names (Caffe's Solver::Restore). Of several
        ranks, rank 0 reads the files and sends what it read to the others."""
        if self.is_root:
            snapshot.restore(self, state_file)
        if self.world is not None:
            distributed.share_state(self, self.world)


def _duration(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
