# Cross-compiling for 64-bit ARM (AArch64) with Debian's cross toolchain
# (g++-aarch64-linux-gnu) against the :arm64 multiarch packages, the
# binaries run under qemu-user (scripts/test-arm.sh).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
# The target's packages (multiarch: /usr/lib/aarch64-linux-gnu), and
# ATTNSERVE_ARM_SYSROOT for those that cannot be installed beside their
# x86-64 copies (oneDNN's headers differ between the two).
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu /usr ${ATTNSERVE_ARM_SYSROOT})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
# ctest and test discovery run the binaries through qemu.
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64 -L /usr/aarch64-linux-gnu)
