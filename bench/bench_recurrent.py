"""Per-step cost of cct's LSTM and RNN layers (layers/recurrent.py) against the
plain numpy version (layers/recurrent_reference.py: one step at a time, its
own input GEMM and weight-gradient GEMMs at every step), side by side in one
process: the two alternate round after round, so load on a shared machine
hits both alike, and the ratio is taken per round.

    python bench/bench_recurrent.py [--sizes 28x64x28x128,50x32x256x256] [--rounds 15] [--threads 1]

A size is TxNxDxH: T steps, N streams, D inputs per step, H hidden units.
Both run float32 on the same weights and inputs (cont 0 at step 0, then 1),
forward and then backward from a fixed top diff. Reported: microseconds per
time step (median over rounds), the per-round ratio numpy / cct (median), and
cct's GFLOP/s (the layer's FLOP count) against the sgemm peak of the same run.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import cct.layers.recurrent_reference as plain  # noqa: E402


def parse_size(text):
    steps, streams, inputs, hidden = (int(v) for v in text.split("x"))
    return steps, streams, inputs, hidden


class Case:
    """One layer type at one size: cct's layer and the plain version on the same numbers."""

    def __init__(self, type_name, size, seed=0):
        import cct
        from cct.testing.gradient_check import make_layer
        self.type_name, (steps, streams, inputs, hidden) = type_name, size
        rng = np.random.default_rng(seed)
        self.layer = make_layer(f'type: "{type_name}" recurrent_param {{ num_output: {hidden} '
                                'weight_filler { type: "uniform" min: -0.1 max: 0.1 } }')
        self.x, self.cont, self.top = cct.Blob((steps, streams, inputs)), cct.Blob((steps, streams)), cct.Blob()
        self.x.data[...] = rng.standard_normal(self.x.shape)
        self.cont.data[...] = 1
        self.cont.data[0] = 0
        self.layer.set_up([self.x, self.cont], [self.top])
        self.top.diff[...] = rng.standard_normal(self.top.shape)
        self.zeros = np.zeros((streams, hidden), np.float32)
        self.steps = steps

    def cct_forward(self):
        self.layer.forward([self.x, self.cont], [self.top])

    def cct_backward(self):
        self.layer.backward([self.top], [True, False], [self.x, self.cont])

    def plain_forward(self):
        weights = [blob.data for blob in self.layer.blobs]
        if self.type_name == "LSTM":
            result = plain.lstm_forward(self.x.data, self.cont.data, weights, self.zeros, self.zeros)
        else:
            result = plain.rnn_forward(self.x.data, self.cont.data, weights, self.zeros)
        self.plain_out, self.cache = result[0], result[-1]

    def plain_backward(self):
        (plain.lstm_backward if self.type_name == "LSTM" else plain.rnn_backward)(self.top.diff, self.cache)

    def check(self):
        """Both give the same output (float32 rounding apart) before anything is timed."""
        self.cct_forward()
        self.plain_forward()
        assert np.allclose(self.top.data, self.plain_out, atol=1e-4), "cct and the plain version disagree"


def per_step_us(function, steps, repeats):
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - start) / repeats / steps * 1e6


def measure(case, rounds, repeats):
    """{name: [us per step, one per round]} with cct and numpy alternating."""
    runs = {"cct forward": case.cct_forward, "cct backward": case.cct_backward,
            "numpy forward": case.plain_forward, "numpy backward": case.plain_backward}
    for function in runs.values():
        function()                               # warm-up (numba compiles the cell backward once)
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, function in runs.items():     # forward before its backward, for both
            times[name].append(per_step_us(function, case.steps, repeats))
    return times


def report(case, size, times, peak):
    """Medians per part; cct's GFLOP/s from the layer's own FLOP count (Layer.flops)
    against the sgemm peak measured in this run."""
    ratio = lambda a, b: statistics.median(x / y for x, y in zip(times[a], times[b]))  # noqa: E731
    forward, backward_data, backward_params = case.layer.flops([case.x, case.cont], [case.top])
    flops = {"forward": forward / case.steps, "backward": (backward_data + backward_params) / case.steps}
    rows = []
    for part in ("forward", "backward"):
        cct_us, numpy_us = statistics.median(times["cct " + part]), statistics.median(times["numpy " + part])
        rate = flops[part] / cct_us / 1e3
        rows.append(f"  {part:8s}  cct {cct_us:8.1f} us/step   numpy {numpy_us:8.1f} us/step   "
                    f"numpy/cct {ratio('numpy ' + part, 'cct ' + part):.2f}   "
                    f"cct {flops[part] / 1e6:.1f} MFLOP/step, {rate:.0f} GFLOP/s = {100 * rate / peak:.0f}% of peak")
    both = [f + b for f, b in zip(times["cct forward"], times["cct backward"])]
    plain = [f + b for f, b in zip(times["numpy forward"], times["numpy backward"])]
    rows.append(f"  {'both':8s}  cct {statistics.median(both):8.1f} us/step   numpy "
                f"{statistics.median(plain):8.1f} us/step   numpy/cct "
                f"{statistics.median(p / c for p, c in zip(plain, both)):.2f}")
    print(f"{case.type_name} T={size[0]} N={size[1]} D={size[2]} H={size[3]}")
    print("\n".join(rows))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="28x64x28x128,50x32x256x256",
                        help="comma-separated TxNxDxH (default: the digits model's, and a wider one)")
    parser.add_argument("--types", default="LSTM,RNN", help="layer types (default LSTM,RNN)")
    parser.add_argument("--rounds", type=int, default=15, help="alternating rounds (medians over them)")
    parser.add_argument("--repeats", type=int, default=5, help="calls per timed block")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads (default 1)")
    args = parser.parse_args()
    from threadpoolctl import threadpool_limits
    threadpool_limits(limits=args.threads, user_api="blas")
    print(common.machine_line())
    peak = common.gemm_peak(1024, 5)
    print(f"sgemm peak (1024, {args.threads} BLAS thread(s)): {peak:.1f} GFLOP/s")
    for type_name in args.types.split(","):
        for size in (parse_size(s) for s in args.sizes.split(",")):
            case = Case(type_name, size)
            case.check()
            report(case, size, measure(case, args.rounds, args.repeats), peak)
    print(f"load after: {common.load_average():.2f}")


if __name__ == "__main__":
    main()
