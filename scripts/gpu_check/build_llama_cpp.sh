#!/usr/bin/env bash
# llama-cpp-python 0.3.36 with ggml's CUDA backend for sm_90 (H200) only, for gpu_check's `llama-cpp`
# section on the GPU machine (which cannot download). Three ways (docs/gpu-results.md, "llama.cpp
# beside metatp", has the measured times and sizes):
#
#   nice -n 19 scripts/gpu_check/build_llama_cpp.sh wheel   # here: the wheel into .whl/ (slow on 2 cores)
#   scripts/gpu_check/build_llama_cpp.sh pack                # here: the trimmed source into .whl/ (a few MiB)
#   scripts/gpu_check/build_llama_cpp.sh device              # there: build that source on its 16 cores and
#                                                            # install into /tmp/site (no network needed)
#   (WORK=... WHEEL_DIR=... JOBS=... PYTHON=... override the defaults below)
#
# Why each choice:
# - only sm_90, GGML_NATIVE off, no FA all-quants, no llava/mtmd, no tests/examples/tools, no NCCL:
#   every ggml-cuda .cu file is compiled once per architecture, so one architecture and the default
#   flash-attention instances keep both build time and the wheel small (the wheel travels in 64 MiB).
# - cuBLAS: this machine's CUDA 13.0 has nvcc and cudart but no cuBLAS, so its headers and library
#   come from the nvidia-cublas 13.0 wheel, used only to compile and link (the GPU image has the same
#   package). Nothing of cuBLAS goes into the wheel: the section puts the image's on LD_LIBRARY_PATH.
# - libcuda: ggml-cuda links the driver API (VMM pool); there is no driver here and no stubs/ folder,
#   so it links against a stub with the eleven cu* functions ggml calls and the soname libcuda.so.1.
# - the wheel is tagged py3-none-linux_x86_64 (llama-cpp-python loads its libraries with ctypes), so
#   Python 3.11 here builds what the image's 3.12 installs. Symbols are stripped (install.strip), and
#   slim_wheel.py keeps one copy of each library (pip's zip holds six of each: 18.6 -> 3.7 MiB for
#   the CPU build).
# Never without nice on a shared machine, and JOBS=2 at most there; it prints the time it took.
set -euo pipefail

MODE=${1:-wheel}
VERSION=0.3.36
SDIST=llama_cpp_python-$VERSION
CUBLAS_SPEC='nvidia-cublas>=13.0,<13.1'
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${WORK:-/tmp/llama-cpp-build}
WHEEL_DIR=${WHEEL_DIR:-$ROOT/.whl}
PYTHON=${PYTHON:-python3}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
SRC_TAR=$WHEEL_DIR/$SDIST-src.tar.gz
start=$(date +%s)
mkdir -p "$WORK" "$WHEEL_DIR"
cd "$WORK"

fetch_sdist() {
  if [ ! -d "$SDIST" ]; then
    "$PYTHON" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d sdist
    tar xzf "sdist/$SDIST.tar.gz"
  fi
}

cublas_dir() {
  # The nvidia-cublas package's nvidia/cu13 (headers + libcublas.so.13): the image's own (device),
  # else the wheel's, downloaded once and unpacked here.
  local d
  d=$("$PYTHON" - <<'EOF'
import sys
from pathlib import Path
for p in sys.path:
    d = Path(p or ".") / "nvidia" / "cu13"
    if (d / "include" / "cublas_v2.h").is_file() and any((d / "lib").glob("libcublas.so.*")):
        print(d)
        break
EOF
)
  if [ -z "$d" ]; then
    if [ ! -f cublas/nvidia/cu13/lib/libcublas.so.13 ]; then
      "$PYTHON" -m pip download -q --no-deps --only-binary :all: "$CUBLAS_SPEC" -d cublas-wheel
      mkdir -p cublas && (cd cublas && "$PYTHON" -m zipfile -e ../cublas-wheel/nvidia_cublas-*.whl .)
    fi
    d=$WORK/cublas/nvidia/cu13
  fi
  # FindCUDAToolkit wants the unversioned names: links here, beside the build
  mkdir -p cublas-link
  ln -sf "$d/lib/libcublas.so.13" cublas-link/libcublas.so
  ln -sf "$d/lib/libcublasLt.so.13" cublas-link/libcublasLt.so
  echo "$d"
}

cuda_stub() {
  mkdir -p cudastub
  local names="cuDeviceGet cuDeviceGetAttribute cuGetErrorString cuMemAddressFree cuMemAddressReserve
    cuMemCreate cuMemGetAllocationGranularity cuMemMap cuMemRelease cuMemSetAccess cuMemUnmap"
  for n in $names; do echo "int $n(void) { return 999; }"; done > cudastub/stub.c
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o cudastub/libcuda.so cudastub/stub.c
}

build_wheel() {   # $1: the source folder, $2: where the wheel goes, then pip's extra arguments
  local src=$1 dest=$2
  shift 2
  local cublas
  cublas=$(cublas_dir)
  cuda_stub
  export CUDACXX=$CUDA_HOME/bin/nvcc
  export CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-2}
  export CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=off \
 -DGGML_CUDA_FA_ALL_QUANTS=off -DGGML_CUDA_NCCL=off -DLLAVA_BUILD=off -DLLAMA_BUILD_APP=off \
 -DLLAMA_BUILD_TESTS=off -DLLAMA_BUILD_EXAMPLES=off -DLLAMA_BUILD_TOOLS=off -DLLAMA_BUILD_SERVER=off \
 -DCUDA_cublas_LIBRARY=$WORK/cublas-link/libcublas.so -DCUDA_cublasLt_LIBRARY=$WORK/cublas-link/libcublasLt.so \
 -DCUDA_cuda_driver_LIBRARY=$WORK/cudastub/libcuda.so \
 -DCMAKE_CUDA_FLAGS=-I$cublas/include -DCMAKE_CXX_FLAGS=-I$cublas/include"
  rm -f "$dest"/llama_cpp_python-*.whl
  "$PYTHON" -m pip wheel -v --no-deps -w "$dest" "$@" \
    -Cbuild-dir="$WORK/build" -Cinstall.strip=true -Ccmake.build-type=Release \
    "$src" > "$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; exit 1; }
  # one copy of each library instead of six (a zip has no symlinks; see slim_wheel.py)
  "$PYTHON" "$ROOT/scripts/gpu_check/slim_wheel.py" "$dest"/llama_cpp_python-*.whl
}

report() {
  local end wheel
  end=$(date +%s)
  wheel=$(ls "$1"/llama_cpp_python-"$VERSION"-*.whl)
  echo "built $wheel: $(du -m "$wheel" | cut -f1) MiB in $(( (end - start) / 60 )) min $(( (end - start) % 60 )) s"
  "$PYTHON" -m zipfile -l "$wheel" | grep '\.so' || true
}

case $MODE in
  wheel)
    fetch_sdist
    build_wheel "$WORK/$SDIST" "$WHEEL_DIR"
    report "$WHEEL_DIR"
    ;;
  pack)
    # What the build with the options above reads: the bindings, and of llama.cpp its CMake files,
    # ggml, src, include, common and vendor (the 75 MB sdist is mostly models/, docs/ and tools/).
    fetch_sdist
    tar czf "$SRC_TAR" --exclude='*.gguf' --exclude='ggml/src/ggml-sycl' --exclude='ggml/src/ggml-vulkan' \
      --exclude='ggml/src/ggml-opencl' --exclude='ggml/src/ggml-cann' --exclude='ggml/src/ggml-webgpu' \
      --exclude='ggml/src/ggml-metal' \
      "$SDIST"/{pyproject.toml,CMakeLists.txt,README.md,LICENSE.md,PKG-INFO,llama_cpp} \
      "$SDIST"/vendor/llama.cpp/{CMakeLists.txt,LICENSE,cmake,ggml,src,include,common,vendor,licenses}
    echo "packed $SRC_TAR: $(du -k "$SRC_TAR" | cut -f1) KiB"
    ;;
  device)
    # On the GPU machine: the image has nvcc, cmake, ninja, scikit-build-core and nvidia-cublas;
    # nothing is downloaded. The wheel goes to $WORK/wheel and is installed into /tmp/site.
    [ -f "$SRC_TAR" ] || { echo "no $SRC_TAR: run '$0 pack' on the CPU machine first"; exit 1; }
    rm -rf "$SDIST" && tar xzf "$SRC_TAR"
    JOBS=${JOBS:-$(nproc)} build_wheel "$WORK/$SDIST" "$WORK/wheel" --no-build-isolation --no-index
    report "$WORK/wheel"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WORK"/wheel/*.whl
    ;;
  *)
    echo "usage: $0 [wheel|pack|device]"; exit 2
    ;;
esac
