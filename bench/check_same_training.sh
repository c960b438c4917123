#!/usr/bin/env bash
# The same numbers before and after a runtime change (issue 35): `cct train`
# on the digits with the LeNet solver, random_seed 1701, 1,500 iterations,
# the sequential schedule, once with an install of the tree before (DIR, made
# with `pip install --no-deps --target DIR <checkout>`) first on PYTHONPATH
# and once with this checkout's; `cmp` of the _iter_1500 caffemodel and
# solverstate. One CCT_CACHE_DIR for both, so both take the same lowerings.
#
#   bash bench/check_same_training.sh DIR [ITERATIONS]
set -euo pipefail
before=$(cd "$1" && pwd)
iterations=${2:-1500}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
work=$(mktemp -d)
export CCT_CACHE_DIR=$work/cache
mkdir -p "$work/examples_out"
cd "$work"
"$python" -m cct.cli digits > /dev/null
sed -e 's/^solver_mode: CPU/random_seed: 1701\nsolver_mode: CPU/' -e "s/^max_iter: .*/max_iter: $iterations/" \
    -e "s/^snapshot: .*/snapshot: $iterations/" "$repo/models/lenet/lenet_solver.prototxt" > solver.prototxt
for side in before after; do
    # the same paths on both sides: the solverstate names the caffemodel it goes with
    mkdir -p "$side/models/lenet" "$side/examples_out"
    cp solver.prototxt "$side/models/lenet/solver.prototxt"
    cp "$repo/models/lenet/lenet_train_test.prototxt" "$side/models/lenet/"
    ln -s "$work/examples_out/digits_train_lmdb" "$work/examples_out/digits_test_lmdb" "$side/examples_out/"
    prefix=$([ "$side" = before ] && echo "$before" || echo "")
    (cd "$side" && PYTHONPATH=$prefix "$python" -m cct.cli train --solver=models/lenet/solver.prototxt \
        --schedule sequential > log 2>&1) || { tail "$side/log"; exit 1; }
    PYTHONPATH=$prefix "$python" -c 'import cct, sys; print(sys.argv[1], "ran", cct.__file__)' "$side"
done
for file in "lenet_iter_$iterations.caffemodel" "lenet_iter_$iterations.solverstate"; do
    cmp "before/examples_out/$file" "after/examples_out/$file" && echo "$file: byte for byte the same"
done
rm -rf "$work"
