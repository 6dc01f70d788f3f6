#!/bin/sh
# Runs an AArch64 program of the cross build under qemu-user (CMAKE_CROSSCOMPILING_EMULATOR of
# aarch64-linux-gnu.cmake): the CPU model is DATTN_QEMU_CPU ("max" by default: every extension,
# SVE included; e.g. "cortex-a72" for NEON alone, "neoverse-n1" for NEON with dot products,
# "max,sve-default-vector-length=32" for 256-bit SVE). The loader and every library are Debian's
# multiarch arm64 ones (libc6, libstdc++6, libgomp1 :arm64), one glibc: with -L
# /usr/aarch64-linux-gnu the cross toolchain's loader met the multiarch libc.so.6 and the
# first pthread_create looped forever in its stack cache.
exec qemu-aarch64 -cpu "${DATTN_QEMU_CPU:-max}" "$@"
