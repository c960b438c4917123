"""`cct train` and `cct test`: Caffe's train and test actions."""
import logging
import signal

import numpy as np

from cct.core import caffe_name
from cct.core.errors import ConfigError
from cct.cli.commands import (EFFECTS, GPU, HYBRID, LEVEL, MEMORY_LIMIT, PHASE, SCHEDULE, STAGE, apply_gpu,
                              apply_memory_limit, apply_schedule, arguments, check_iterations, command, flag, fmt,
                              phase, require, stages)

log = logging.getLogger("cct.cli")


# --- train -----------------------------------------------------------------------------------
@command("train", "train or fine-tune a model")
@arguments(
    flag("--solver", default="", help="the solver definition (prototxt); a Python layer in its nets runs the "
                                      "code of the module it names, as in Caffe: train only files you trust"),
    flag("--weights", default="", help="weights to fine-tune from, comma separated .caffemodel/.h5 files; "
                                       "not with --snapshot"),
    flag("--snapshot", default="", help="a .solverstate(.h5) to resume training from; not with --weights"),
    LEVEL, STAGE, GPU, HYBRID, SCHEDULE, MEMORY_LIMIT,
    flag("--sigint_effect", default="stop", choices=EFFECTS,
         help="what Ctrl-C (SIGINT) does: stop (and snapshot, if snapshot_after_train), snapshot, none"),
    flag("--sighup_effect", default="snapshot", choices=EFFECTS,
         help="what SIGHUP does: stop, snapshot (and go on), none"),
)
def train(args):
    from cct.training import distributed
    from cct.training.solver import get_solver, load_solver_param
    from cct.proto import caffe_pb2
    from cct.runtime import memory_plan
    require(args.solver, "--solver", "need a solver definition to train")
    if args.snapshot and args.weights:
        raise ConfigError("--snapshot, --weights: give a snapshot to resume training or weights to "
                          "fine-tune, not both")
    apply_schedule(args)
    apply_memory_limit(args)
    world = distributed.world()
    if world is not None and not world.is_root:
        logging.getLogger("cct").setLevel(logging.WARNING)     # rank 0 tells the story (Caffe's LOG_IF root)
    param = load_solver_param(args.solver)
    # The first line of a run: the module a Python layer's `import caffe` gets decides what it runs on.
    log.info("import caffe: %s", caffe_name.caffe_import())
    apply_gpu(args)
    param.train_state.level = args.level
    param.train_state.stage.extend(stages(args.stage))
    # As caffe.cpp: --snapshot or --weights replace the solver's own `weights:`.
    if args.snapshot or args.weights:
        param.ClearField("weights")
    if args.weights:
        param.weights.append(args.weights)
    if param.solver_mode == caffe_pb2.SolverParameter.GPU and args.gpu in (None, ""):
        log.info("solver_mode: GPU: cct computes on the host unless --gpu names an OpenCL device")
    # Nothing outside the run reads an activation's diff: share them (cct.runtime.memory).
    solver = get_solver(param, source=args.solver, share_diffs=True)
    with _signal_effects(solver, args.sigint_effect, args.sighup_effect):
        solver.solve(args.snapshot or None)
    log.info("%s", memory_plan.measured_line(solver.memory_plan))
    return 0


class _signal_effects:
    """While training: SIGINT / SIGHUP ask the solver for their configured action."""

    def __init__(self, solver, sigint_effect, sighup_effect):
        self.effects = {signal.SIGINT: sigint_effect}
        if hasattr(signal, "SIGHUP"):
            self.effects[signal.SIGHUP] = sighup_effect
        self.solver = solver
        self.previous = {}

    def __enter__(self):
        for number, effect in self.effects.items():
            try:
                self.previous[number] = signal.signal(number, self._handler(effect))
            except ValueError:          # not the main thread: leave signals alone
                pass
        return self

    def _handler(self, effect):
        def handle(number, frame):
            log.info("%s received: %s", signal.Signals(number).name, effect)
            self.solver.request_action(effect)
        return handle

    def __exit__(self, *exc):
        for number, previous in self.previous.items():
            signal.signal(number, previous)
        return False


# --- test --------------------------------------------------------------------------------------
@command("test", "score a model: mean of every output over --iterations batches")
@arguments(
    flag("--model", default="", help="the net definition (prototxt); a Python layer in it runs the code of "
                                     "the module it names, as in Caffe: score only files you trust"),
    flag("--weights", default="", help="trained weights, comma separated .caffemodel/.h5 files"),
    flag("--iterations", type=int, default=50, help="number of batches to run"),
    PHASE, LEVEL, STAGE, GPU, MEMORY_LIMIT,
)
def test(args):
    from cct.core.layer import TEST
    from cct.core.net import Net
    from cct.core.progress import Progress
    from cct.runtime import fusion
    require(args.model, "--model", "need a model definition to score")
    require(args.weights, "--weights", "need model weights to score")
    check_iterations(args.iterations)
    apply_gpu(args)
    apply_memory_limit(args)
    net = Net(args.model, phase(args, TEST), level=args.level, stages=stages(args.stage))
    fusion.forward_only(net)        # scoring runs no backward: every chain may fuse
    for path in stages(args.weights):
        net.copy_from(path)
    log.info("Running for %d iterations.", args.iterations)
    scores, names, loss = None, [], 0.0
    with Progress("test", args.iterations, "batches") as shown:
        for batch in shown.track(range(args.iterations)):
            loss += net._forward()
            values, names = [], []
            for name in net.outputs:
                for value in net.blobs[name].data.ravel():
                    log.info("Batch %d, %s = %s", batch, name, fmt(value))
                    values.append(float(value))
                    names.append(name)
            scores = np.array(values) if scores is None else scores + values
    log.info("Loss: %s", fmt(loss / args.iterations))
    for name, score in zip(names, scores / args.iterations):
        weight = net.blob_loss_weights.get(name, 0.0)
        suffix = f" (* {fmt(weight)} = {fmt(weight * score)} loss)" if weight else ""
        log.info("%s = %s%s", name, fmt(score), suffix)
    return 0
