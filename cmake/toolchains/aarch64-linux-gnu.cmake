# Cross-building dattn for AArch64 Linux on an x86-64 Debian machine (make test-aarch64):
# Debian's g++-aarch64-linux-gnu, the arm64 libraries the build links from Debian's multiarch
# (libpng-dev:arm64, libpython3-dev:arm64), header-only dependencies through their CMake
# packages, and qemu-user running what was built (CTest's discovery and runs, through
# qemu-aarch64.sh: the CPU model is the environment's DATTN_QEMU_CPU when CTest runs, "max" by
# default).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
# Programs are the build machine's; libraries and headers the multiarch ones (/usr/lib/
# aarch64-linux-gnu beside the shared /usr/include), found through CMAKE_LIBRARY_ARCHITECTURE.
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_CROSSCOMPILING_EMULATOR ${CMAKE_CURRENT_LIST_DIR}/qemu-aarch64.sh)
