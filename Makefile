# dattn quick start: `make run` and `make test` work on a fresh Debian machine.
# They install the Debian packages that are missing, configure, build, then run.

PRESET ?= release
BUILD := build/$(PRESET)
PREFIX ?= $(CURDIR)/out/install
DATTN := build/release/tools/dattn/dattn

# What the build needs from Debian (libgomp, OpenMP's runtime, comes with g++). The Python
# side lives in the project's virtual environment (.venv, below), not in Debian's packages.
DEBIAN_PACKAGES := cmake ninja-build g++ make pkg-config clang-format \
  libgtest-dev libgmock-dev libcli11-dev nlohmann-json3-dev libdlpack-dev libpng-dev \
  libopenmpi-dev openmpi-bin

# What `make fuzz` needs besides: clang with libFuzzer (compiler-rt) and LLVM's OpenMP runtime,
# under Debian's unversioned names (llvm-defaults: clang 14 on Debian 12, 19 on 13).
FUZZ_DEBIAN_PACKAGES := clang libclang-rt-dev libomp-dev
FUZZ_SECONDS ?= 45
FUZZ_TARGETS := fuzz_safetensors fuzz_attend_meta

# The project's Python environment: .venv from python3.11 (the interpreter the PyTorch build on
# disk is for) with requirements.txt, every version pinned; `# no-deps: PKG==V` lines of that
# file are installed with --no-deps (the file says why). Rebuilt when the file changes (the
# stamp holds its checksum). CMake builds dattn's extension for it; `make test` builds the
# wheel (pyproject.toml) on build/release's library and installs it there, as users get it.
VENV_PYTHON ?= python3.11
VENV := .venv
PY := $(CURDIR)/$(VENV)/bin/python
REQUIREMENTS := requirements.txt
VENV_STAMP := $(VENV)/.dattn-requirements.sha256
WHEEL_DIR := build/dist

.PHONY: deps venv wheel configure build run test test-cpu-classes test-aarch64 asan fuzz format format-check install install-check ggml ggml-check sdcpp vllm-omni-env vllm-omni-check comfyui-check clean distclean

deps:
	@missing=""; \
	for p in $(DEBIAN_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "dattn: installing Debian packages:$$missing"; \
	  sudo=""; [ "$$(id -u)" -ne 0 ] && sudo=sudo; \
	  $$sudo apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq --no-install-recommends $$missing; \
	fi

venv: deps
	@sum="$$(sha256sum $(REQUIREMENTS) | cut -d' ' -f1) $(VENV_PYTHON)"; \
	if [ -x $(VENV)/bin/python ] && [ "$$(cat $(VENV_STAMP) 2>/dev/null)" = "$$sum" ]; then exit 0; fi; \
	command -v $(VENV_PYTHON) >/dev/null || { echo "dattn: $(VENV_PYTHON) not found on PATH (the project's interpreter; set VENV_PYTHON=...)"; exit 1; }; \
	if ! $(VENV_PYTHON) -c 'import ensurepip, sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_path("include"), "Python.h")))' 2>/dev/null; then \
	  echo "dattn: $(VENV_PYTHON) lacks venv or its headers: installing Debian's python3.11-venv python3.11-dev"; \
	  $(MAKE) --no-print-directory deps DEBIAN_PACKAGES="python3.11-venv python3.11-dev" || exit 1; \
	fi; \
	echo "dattn: creating $(VENV) from $$(command -v $(VENV_PYTHON)) with $(REQUIREMENTS)"; \
	rm -rf $(VENV) && $(VENV_PYTHON) -m venv $(VENV) && \
	$(VENV)/bin/pip install -q -r $(REQUIREMENTS) && \
	nodeps=$$(sed -n 's/^# no-deps: *//p' $(REQUIREMENTS)) && \
	{ [ -z "$$nodeps" ] || $(VENV)/bin/pip install -q --no-deps $$nodeps; } && \
	echo "$$sum" > $(VENV_STAMP)

# Configures when there is no build yet, or when it was configured for another interpreter
# than .venv's (e.g. before .venv existed). The sanitizer and fuzz presets build no extension.
configure: deps venv
	@want=""; [ -x $(VENV)/bin/python ] && [ "$(PRESET)" = release ] && want="$(PY)"; \
	have=$$(sed -n 's/^Python_EXECUTABLE:[A-Z]*=//p' $(BUILD)/CMakeCache.txt 2>/dev/null); \
	if [ ! -f $(BUILD)/build.ninja ] || [ -n "$$want" -a "$$have" != "$$want" ]; then \
	  cmake --preset $(PRESET) $${want:+-DPython_EXECUTABLE=$$want -Upybind11_DIR}; \
	fi

build: configure
	cmake --build --preset $(PRESET)

run: build
	$(BUILD)/tools/dattn/dattn run

# The wheel (pyproject.toml) built on build/release's library (DATTN_PREBUILT_DIR: only the
# extension is compiled, in build/wheel/prebuilt), installed into .venv.
wheel: build
	rm -rf $(WHEEL_DIR)
	$(PY) -m pip wheel . -q --no-build-isolation --no-deps -w $(WHEEL_DIR) \
	  -C build-dir=build/wheel/prebuilt -C cmake.define.DATTN_PREBUILT_DIR=$(CURDIR)/build/release
	$(PY) -m pip install -q --no-deps --force-reinstall $(WHEEL_DIR)/dattn-*.whl

# CTest, then the Python suite: pytest in .venv on the installed wheel (the source tree's
# python/ is never on sys.path: the tests import the package from .venv's site-packages). The sanitizer build has no Python module (a
# sanitized extension would need the runtime preloaded into the interpreter), so there the
# Python suite is skipped with a message. pytest fails on no tests collected (exit 5) too.
test: build
	ctest --preset $(PRESET)
	@if [ "$(PRESET)" = release ]; then \
	  $(MAKE) --no-print-directory wheel && \
	  echo "dattn: Python tests ($(VENV)/bin/pytest tests/python, dattn from the installed wheel)" && \
	  cd /tmp && $(PY) -c "import dattn; print('dattn: testing', dattn.__file__)" && cd $(CURDIR) && \
	  $(VENV)/bin/pytest -q -p no:cacheprovider --durations=12 tests/python; \
	else \
	  echo "dattn: SKIPPED the Python tests under PRESET=$(PRESET): no Python module there (sanitizers)"; \
	fi

# CTest once more per CPU class in CPU_CLASSES, as if the CPU had only that class's features
# (DATTN_CPU_FEATURES, docs/architecture.md): a test that assumes a feature fails on every
# machine, not only on the class that lacks it. Only the tests whose behaviour can depend on
# the class run masked (engine selection, kernels, conformance, skips, peaks); these run only
# unmasked, in `make test`, where they give the same answer on every class:
#   the out-of-memory probes and the CLI smoke run (large workloads, minutes on the portable
#   engine); REFERENCE's own tests and its conformance cases, and the conformance suite's
#   MINIMAL_TEST backend (which computes with REFERENCE): plain loops, no engine; the portable
#   and portable_int8 engines named through DATTN_ISA (flash_conformance_isa_portable*: no SIMD,
#   nothing read from the CPU's features); the safetensors reader, dtypes, tensor views and
#   DLPack; the validation errors of SPEC §13 (raised before any plan); the bar chart; the CLI's
#   flag errors (cli_flags) and cli_config (which sets DATTN_CPU_FEATURES itself); the process's
#   buffers and the memory layers keep (ProcessMemory*, LayerMemory: allocation, not arithmetic);
#   the AArch64 engines' cases on x86 (their emulated twins compute in portable C++ whatever the
#   mask, the real ones are unavailable on every class).
CPU_CLASSES ?= avx2 portable
MASKED_EXCLUDE := OutOfMemory|cli_smoke|cli_config|cli_flags|^Reference\.|/(REFERENCE|MINIMAL_TEST)(_|$$)|flash_conformance_isa_portable(_int8)?$$|^Safetensors\.|^(DType|TensorView|DLPack)\.|^Spec13/Errors\.|^BarChart|^ProcessMemory|^LayerMemory\.|(/|isa_)(neon|sve)[a-z0-9_]*([^a-z0-9_]|$$)
test-cpu-classes: build
	@for c in $(CPU_CLASSES); do \
	  echo "dattn: CTest with DATTN_CPU_FEATURES=$$c (without $(MASKED_EXCLUDE))"; \
	  DATTN_CPU_FEATURES=$$c ctest --preset $(PRESET) -E '$(MASKED_EXCLUDE)' -j2 --output-on-failure \
	    --output-junit ctest-junit-$$c.xml \
	    > $(BUILD)/ctest-$$c.log 2>&1 || { tail -n 60 $(BUILD)/ctest-$$c.log; exit 1; }; \
	  grep -E "tests passed" $(BUILD)/ctest-$$c.log; \
	done

# AArch64 under emulation (docs/architecture.md, "AArch64"): the library, the CLI, the C++ tests
# and the Python extension cross-built with Debian's g++-aarch64-linux-gnu into build/aarch64
# (cmake/toolchains/aarch64-linux-gnu.cmake; GoogleTest from Debian's sources built with the
# cross compiler into build/aarch64-gtest; libpng and Python's headers from Debian's arm64
# multiarch; dlpack, header-only, through the build machine's CMake package, Debian's not being
# co-installable), then CTest under qemu-user on several CPU models (DATTN_QEMU_CPU, read by
# cmake/toolchains/qemu-aarch64.sh): AARCH64_RUNS, each "cpu model|DATTN_CPU_FEATURES|tests".
# max (SVE at 512 bits) runs every ARM engine's engine and conformance cases against
# REFERENCE, the CPU-feature, engine-choice and never-silently-slow cases, SAGE's and
# VIDEO_SPARSE's engine cases (the twins left out, below), SageEngines (SDOT's and USDOT's logits
# and the NEON quantizers' K tiles held to the twins' bits), FLASH's step cases (BFDOT held to its
# twin's bits), paged KV and the C ABI; max at 256- and 128-bit SVE the sve engine's cases and conformance
# again (its other builds; at 128 bits only by name, neon serving automatic calls), at 1024
# bits its clean skip (no build; neon serves); cortex-a72 (NEON only), neoverse-n1 (NEON with dot
# products) and a64fx (SVE without dot products or BF16) the CPU and engine cases, where
# engines needing what the model lacks skip; max masked to portable the never-silently-slow
# rule, which fires there. Then the Python package on numpy under qemu (AARCH64_PYTHON_RUNS).
AARCH64_DEBIAN_PACKAGES := g++-aarch64-linux-gnu qemu-user libc6:arm64 libstdc++6:arm64 \
  libgomp1:arm64 libpng-dev:arm64 libpython3-dev:arm64
AARCH64_ENGINES := (neon|sve)[a-z0-9_]*
# The end of an engine's name in a test's name: CTest names a parameterized GoogleTest case
# "Engines/FlashEngine.X/neon  # GetParam() = ..." (its value after the name).
AARCH64_END := ([^a-z0-9_]|$$)
AARCH64_CPU_CASES := ^(CpuInfo|CpuFeatureMask|SimdShortfall)\.
# SageInputs' cases of what masks hide and padding holds (garbage in masked keys, padded query
# rows and padded joint text changes no other row's bits), on the real ARM SAGE engines; its
# accuracy case on two token populations takes over 6 minutes under qemu and runs natively only
# (make test, on the twins whose logits SageEngines holds the ARM engines to).
AARCH64_SAGE_GARBAGE := ^SageInputs\.(MaskedKeysChangeNothing|PaddedRowsChangeNothing|PaddedJointTextChangesNothing|NonFiniteRowsStayWhereTheyAre|HugeQueriesDoNotOverflow)$$
AARCH64_RUNS := \
  "max||$(AARCH64_CPU_CASES)|^FlashEngines\.|/$(AARCH64_ENGINES)$(AARCH64_END)|isa_$(AARCH64_ENGINES)$$|isa_portable$$|VideoSparseKernel\.EveryEngine|^Paged\.|PagedConformance|^Sage\.|^SageEngines\.|$(AARCH64_SAGE_GARBAGE)|^FlashSteps\.|^c_api$$" \
  "cortex-a72||$(AARCH64_CPU_CASES)|FlashEngine\..*/$(AARCH64_ENGINES)$(AARCH64_END)" \
  "neoverse-n1||$(AARCH64_CPU_CASES)|FlashEngine\..*/$(AARCH64_ENGINES)$(AARCH64_END)|^SageEngines\." \
  "max,sve-default-vector-length=32||^FlashEngines\.|FlashEngine\..*/sve$(AARCH64_END)|isa_sve$$|VideoSparseKernel\.EveryEngine" \
  "max,sve-default-vector-length=16||$(AARCH64_CPU_CASES)|^FlashEngines\.|FlashEngine\..*/sve$(AARCH64_END)|isa_sve$$" \
  "max,sve-default-vector-length=128||$(AARCH64_CPU_CASES)|^FlashEngines\.|FlashEngine\..*/sve$(AARCH64_END)" \
  "a64fx||$(AARCH64_CPU_CASES)|FlashEngine\..*/$(AARCH64_ENGINES)$(AARCH64_END)" \
  "max|portable|$(AARCH64_CPU_CASES)|FlashEngine\..*/portable$(AARCH64_END)"
# The emulated twins compute in portable C++ (the same code as on x86, where `make test` runs
# their cases): under qemu their own cases are not run (AARCH64_NOT_RUN), the long accuracy loops
# over every engine leave them out (DATTN_TEST_TWINS=0, tests/test_inputs.hpp), and only the
# cases that hold the real instructions to them (FlashSteps, Sage's twin cases) run them.
AARCH64_NOT_RUN := _emulated$(AARCH64_END)
AARCH64_TOOLCHAIN := $(CURDIR)/cmake/toolchains/aarch64-linux-gnu.cmake
# The Python package under qemu (tests/python/test_numpy_calls.py: numpy only, no torch): the
# cross-built extension on Debian's arm64 interpreter (its binary from $(py)-minimal:arm64, its
# standard library from the multiarch libpython3-dev:arm64 above) with PyPI's aarch64 numpy and
# pytest at requirements.txt's pins, in AARCH64_PYTHON; "cpu model|DATTN_CPU_FEATURES" each.
AARCH64_PYTHON := build/aarch64-python
AARCH64_PYTHON_RUNS := "max|" "cortex-a72|" "neoverse-n1|" "max|portable"

test-aarch64:
	@dpkg --print-foreign-architectures | grep -qx arm64 || { \
	  sudo=""; [ "$$(id -u)" -ne 0 ] && sudo=sudo; \
	  echo "dattn: adding Debian's arm64 architecture (multiarch)"; $$sudo dpkg --add-architecture arm64; }
	@$(MAKE) --no-print-directory deps DEBIAN_PACKAGES="$(AARCH64_DEBIAN_PACKAGES)"
	@$(MAKE) --no-print-directory venv
	@if [ ! -f build/aarch64-gtest/install/lib/cmake/GTest/GTestConfig.cmake ]; then \
	  echo "dattn: GoogleTest for AArch64 from /usr/src/googletest"; \
	  cmake -S /usr/src/googletest -B build/aarch64-gtest -G Ninja -DCMAKE_BUILD_TYPE=Release \
	    -DCMAKE_TOOLCHAIN_FILE=$(AARCH64_TOOLCHAIN) \
	    -DCMAKE_INSTALL_PREFIX=$(CURDIR)/build/aarch64-gtest/install > /dev/null && \
	  cmake --build build/aarch64-gtest > /dev/null && cmake --install build/aarch64-gtest > /dev/null; \
	fi
	@if [ ! -f build/aarch64/build.ninja ]; then \
	  py=$$(ls -d /usr/include/aarch64-linux-gnu/python3.* | head -n 1 | xargs basename); \
	  soabi=cpython-$$(echo $$py | tr -d python.)-aarch64-linux-gnu; \
	  cmake -S . -B build/aarch64 -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	    -DCMAKE_TOOLCHAIN_FILE=$(AARCH64_TOOLCHAIN) \
	    -DCMAKE_PREFIX_PATH=$(CURDIR)/build/aarch64-gtest/install \
	    -Ddlpack_DIR=$$(dirname $$(dpkg -L libdlpack-dev | grep 'dlpackConfig.cmake$$')) \
	    -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON -DDATTN_WITH_GGML=OFF \
	    -DPython_EXECUTABLE=$(PY) -DPython_INCLUDE_DIR=/usr/include/$$py \
	    -DPython_SOABI=$$soabi -DPYTHON_MODULE_EXTENSION=.$$soabi.so > /dev/null; \
	fi
	cmake --build build/aarch64
	@file build/aarch64/python/dattn/_core.cpython-*-aarch64-linux-gnu.so | grep -q "ARM aarch64" || \
	  { echo "dattn: the cross-built Python extension is missing or not AArch64"; exit 1; }
	@for run in $(AARCH64_RUNS); do \
	  cpu=$${run%%|*}; rest=$${run#*|}; mask=$${rest%%|*}; tests=$${rest#*|}; \
	  log=build/aarch64/ctest-$$cpu$${mask:+-$$mask}.log; \
	  echo "dattn: CTest under qemu-aarch64 -cpu $$cpu$${mask:+, DATTN_CPU_FEATURES=$$mask}"; \
	  DATTN_QEMU_CPU=$$cpu DATTN_CPU_FEATURES=$$mask DATTN_TEST_TWINS=0 \
	    ctest --test-dir build/aarch64 -R "$$tests" \
	    -E "$(AARCH64_NOT_RUN)" -j2 --timeout 600 --output-on-failure > $$log 2>&1 || { tail -n 60 $$log; exit 1; }; \
	  grep -E "tests passed" $$log; \
	  grep -c "Skipped" $$log | xargs printf '  skipped: %s\n'; \
	done
	@py=$$(ls -d /usr/include/aarch64-linux-gnu/python3.* | head -n 1 | xargs basename); \
	if [ ! -x $(AARCH64_PYTHON)/usr/bin/$$py ] || [ ! -d $(AARCH64_PYTHON)/site/numpy ]; then \
	  echo "dattn: Debian's arm64 $$py and PyPI's numpy and pytest for it, into $(AARCH64_PYTHON)"; \
	  rm -rf $(AARCH64_PYTHON) && mkdir -p $(AARCH64_PYTHON)/debs && \
	  sudo=""; [ "$$(id -u)" -ne 0 ] && sudo=sudo; \
	  (cd $(AARCH64_PYTHON)/debs && { apt-get download -q $$py-minimal:arm64 || \
	    { echo "dattn: apt-get update (the package lists lack $$py-minimal:arm64)"; \
	      $$sudo apt-get update -qq && apt-get download -q $$py-minimal:arm64; }; } 2>&1 | \
	    grep -v "^W: Download is performed unsandboxed"); \
	  dpkg -x $(AARCH64_PYTHON)/debs/$$py-minimal_*_arm64.deb $(AARCH64_PYTHON) && \
	  $(PY) -m pip install --quiet --disable-pip-version-check --target $(AARCH64_PYTHON)/site \
	    --only-binary=:all: --platform manylinux_2_28_aarch64 --platform manylinux_2_27_aarch64 \
	    --platform manylinux2014_aarch64 --implementation cp --python-version $${py#python} \
	    --abi cp$$(echo $${py#python} | tr -d .) -c requirements.txt numpy pytest 2>&1 | \
	    grep -v "requires\|dependency resolver" || true; \
	  [ -x $(AARCH64_PYTHON)/usr/bin/$$py ] && [ -d $(AARCH64_PYTHON)/site/numpy ] || \
	    { echo "dattn: the arm64 interpreter or numpy did not install"; exit 1; }; \
	fi; \
	for run in $(AARCH64_PYTHON_RUNS); do \
	  cpu=$${run%%|*}; mask=$${run#*|}; log=$(AARCH64_PYTHON)/pytest-$$cpu$${mask:+-$$mask}.log; \
	  echo "dattn: pytest tests/python/test_numpy_calls.py under qemu-aarch64 -cpu $$cpu$${mask:+, DATTN_CPU_FEATURES=$$mask}"; \
	  DATTN_QEMU_CPU=$$cpu DATTN_CPU_FEATURES=$$mask DATTN_TEST_TWINS=0 PYTHONDONTWRITEBYTECODE=1 \
	    PYTHONPATH=$(CURDIR)/$(AARCH64_PYTHON)/site:$(CURDIR)/build/aarch64/python \
	    cmake/toolchains/qemu-aarch64.sh $(AARCH64_PYTHON)/usr/bin/$$py -m pytest --noconftest -q \
	    -p no:cacheprovider tests/python/test_numpy_calls.py > $$log 2>&1 || { tail -n 60 $$log; exit 1; }; \
	  tail -n 1 $$log; \
	done

# The whole suite under AddressSanitizer + UndefinedBehaviorSanitizer; the ggml operator's
# tests too where `make ggml-check` has built ggml (CI runs that first).
asan:
	@if [ -f $(GGML_PREFIX)/lib/cmake/ggml/ggml-config.cmake ]; then \
	  $(MAKE) --no-print-directory configure PRESET=asan && \
	  cmake build/asan -Dggml_DIR=$(GGML_PREFIX)/lib/cmake/ggml -DDATTN_GGML_MAX_NAME=$(GGML_MAX_NAME) > /dev/null; \
	fi
	$(MAKE) test PRESET=asan

# The libFuzzer targets of tests/fuzz (clang, ASan + UBSan, build/fuzz), each run for
# FUZZ_SECONDS from its seed corpus (tests/fuzz/corpus/<target>), all of them at once (one
# process each: libFuzzer runs on one core); new inputs go to build/fuzz/corpus/<target>,
# crashing ones to build/fuzz/artifacts/, each target's output to build/fuzz/<target>.log.
# Fails on any finding, naming the target.
fuzz:
	$(MAKE) deps DEBIAN_PACKAGES="$(DEBIAN_PACKAGES) $(FUZZ_DEBIAN_PACKAGES)"
	cmake --preset fuzz
	cmake --build --preset fuzz
	@pids=""; for t in $(FUZZ_TARGETS); do \
	  mkdir -p build/fuzz/corpus/$$t build/fuzz/artifacts && \
	  echo "dattn: fuzzing $$t for $(FUZZ_SECONDS) s (build/fuzz/$$t.log)" && \
	  { build/fuzz/tests/fuzz/$$t -max_total_time=$(FUZZ_SECONDS) -timeout=10 \
	      -dict=tests/fuzz/json.dict -print_final_stats=1 \
	      -artifact_prefix=build/fuzz/artifacts/$$t- build/fuzz/corpus/$$t tests/fuzz/corpus/$$t \
	      > build/fuzz/$$t.log 2>&1 & } ; pids="$$pids $$!:$$t"; \
	done; \
	failed=""; for p in $$pids; do \
	  t=$${p#*:}; \
	  if wait $${p%%:*}; then grep -E "^(Done|stat::number_of_executed_units)" build/fuzz/$$t.log | sed "s/^/$$t: /"; \
	  else echo "dattn: fuzzing $$t FAILED:"; tail -n 80 build/fuzz/$$t.log; failed="$$failed $$t"; fi; \
	done; \
	[ -z "$$failed" ] || { echo "dattn: fuzz findings in:$$failed (inputs in build/fuzz/artifacts/)"; exit 1; }

format:
	git ls-files '*.cpp' '*.hpp' | xargs clang-format -i

format-check: deps
	git ls-files '*.cpp' '*.hpp' | xargs clang-format --dry-run --Werror

install: build
	cmake --install $(BUILD) --prefix $(PREFIX)

# Installs into a scratch prefix and builds examples/consumer against it, once through
# find_package(dattn) and once through pkg-config, and examples/consumer_c with the C compiler
# alone through pkg-config dattn-c (the C ABI); then imports the installed Python package.
install-check:
	rm -rf out/install-check
	$(MAKE) install PREFIX=$(CURDIR)/out/install-check/prefix
	cmake -S examples/consumer -B out/install-check/cmake -G Ninja \
	  -DCMAKE_PREFIX_PATH=$(CURDIR)/out/install-check/prefix
	cmake --build out/install-check/cmake
	out/install-check/cmake/consumer
	PKG_CONFIG_PATH=$(CURDIR)/out/install-check/prefix/lib/pkgconfig \
	  sh -c 'g++ -std=c++20 examples/consumer/main.cpp $$(pkg-config --cflags --libs dattn) \
	    -Wl,-rpath,$(CURDIR)/out/install-check/prefix/lib -o out/install-check/consumer-pc'
	out/install-check/consumer-pc
	PKG_CONFIG_PATH=$(CURDIR)/out/install-check/prefix/lib/pkgconfig \
	  sh -c 'cc -std=c99 -pedantic -Wall -Werror examples/consumer_c/main.c \
	    $$(pkg-config --cflags --libs dattn-c) -Wl,-rpath,$(CURDIR)/out/install-check/prefix/lib \
	    -o out/install-check/consumer-c'
	out/install-check/consumer-c
	cd /tmp && PYTHONPATH=$$(ls -d $(CURDIR)/out/install-check/prefix/lib/python3*/site-packages) \
	  $(PY) -c "import dattn, numpy; assert dattn.__file__.startswith('$(CURDIR)/out/install-check/'), dattn.__file__; \
	    print('installed dattn', dattn.__file__, \
	    dattn.Attention(num_heads=1, head_size=8).forward(*[numpy.ones((1, 3, 1, 8), numpy.float32)] * 3).shape)"

# ggml and stable-diffusion.cpp from the PyPI sdist of stable-diffusion-cpp-python (pinned,
# its sha256 checked), which vendors both: build/ggml/ holds the download, the sources and
# ggml built (Release, GGML_NATIVE) and installed into build/ggml/prefix.
SDCPP_PY_VERSION := 0.4.7
SDCPP_PY_SHA256 := 998d1957260dd5ae4e18a8acc0c14b0a8757aaa9f96515197b6d5bbf46df9282
GGML_WORK := build/ggml
SDCPP_SDIST := $(GGML_WORK)/dl/stable_diffusion_cpp_python-$(SDCPP_PY_VERSION).tar.gz
SDCPP_SRC := $(GGML_WORK)/stable_diffusion_cpp_python-$(SDCPP_PY_VERSION)/vendor/stable-diffusion.cpp
GGML_PREFIX := $(CURDIR)/$(GGML_WORK)/prefix
# sd.cpp builds its ggml with tensor names of up to 128 characters (and checks it); ggml.h's
# default is 64. Consumers must agree: dattn_ggml gets it as DATTN_GGML_MAX_NAME.
GGML_MAX_NAME := 128

$(SDCPP_SDIST): | venv
	mkdir -p $(GGML_WORK)/dl
	$(PY) -m pip download -q --no-deps --no-binary :all: -d $(GGML_WORK)/dl \
	  stable-diffusion-cpp-python==$(SDCPP_PY_VERSION)
	echo "$(SDCPP_PY_SHA256)  $@" | sha256sum -c - || { rm -f $@; exit 1; }

$(SDCPP_SRC)/CMakeLists.txt: $(SDCPP_SDIST)
	tar -xzf $< -C $(GGML_WORK)
	touch $@

$(GGML_PREFIX)/lib/cmake/ggml/ggml-config.cmake: $(SDCPP_SRC)/CMakeLists.txt
	cmake -S $(SDCPP_SRC)/ggml -B $(GGML_WORK)/build -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF \
	  "-DCMAKE_C_FLAGS=-DGGML_MAX_NAME=$(GGML_MAX_NAME)" "-DCMAKE_CXX_FLAGS=-DGGML_MAX_NAME=$(GGML_MAX_NAME)" \
	  -DCMAKE_INSTALL_PREFIX=$(GGML_PREFIX)
	cmake --build $(GGML_WORK)/build
	cmake --install $(GGML_WORK)/build > /dev/null

ggml: $(GGML_PREFIX)/lib/cmake/ggml/ggml-config.cmake

# The ggml operator (include/dattn/ggml.h) built against that ggml in $(BUILD) and its graph
# tests (CTest label ggml), then a short run of its benchmark.
ggml-check: build ggml
	cmake $(BUILD) -Dggml_DIR=$(GGML_PREFIX)/lib/cmake/ggml \
	  -DDATTN_GGML_MAX_NAME=$(GGML_MAX_NAME) > /dev/null
	cmake --build $(BUILD) --target dattn_ggml test_ggml bench_ggml_attention
	ctest --test-dir $(BUILD) -L ggml --output-on-failure
	$(BUILD)/bench_ggml_attention --workload check:700:900:3:128 --rounds 1

# stable-diffusion.cpp from the same sdist with integrations/stable-diffusion.cpp/dattn.patch
# (its flash path on dattn_ggml_flash_attn_ext), against that ggml and dattn installed into
# build/sdcpp/dattn-prefix, and sdcpp_dit_bench (its Flux and Wan runners, random weights) run
# small; SDCPP_BENCH_ARGS runs it at real sizes instead (docs/stable-diffusion-cpp.md).
SDCPP_WORK := build/sdcpp
SDCPP_BENCH_ARGS ?= --model flux --width 256 --height 256 --paths ggml-fa,dattn,dattn-sage,mul-mat
sdcpp: ggml-check
	cmake --install $(BUILD) --prefix $(CURDIR)/$(SDCPP_WORK)/dattn-prefix > /dev/null
	rm -rf $(SDCPP_WORK)/src && mkdir -p $(SDCPP_WORK) && cp -r $(SDCPP_SRC) $(SDCPP_WORK)/src
	patch -s -p1 -d $(SDCPP_WORK)/src < integrations/stable-diffusion.cpp/dattn.patch
	cmake -S integrations/stable-diffusion.cpp -B $(SDCPP_WORK)/build -G Ninja \
	  -DCMAKE_BUILD_TYPE=Release -DSDCPP_SOURCE_DIR=$(CURDIR)/$(SDCPP_WORK)/src \
	  -DCMAKE_PREFIX_PATH="$(GGML_PREFIX);$(CURDIR)/$(SDCPP_WORK)/dattn-prefix" > /dev/null
	cmake --build $(SDCPP_WORK)/build --target sdcpp_dit_bench
	$(SDCPP_WORK)/build/sdcpp_dit_bench $(SDCPP_BENCH_ARGS)

# vllm-omni's real engine on the CPU: its own environment, .venv-vllm-omni (vLLM's CPU build,
# vllm-omni and what they pull in, every package pinned in requirements-vllm-omni.txt and
# installed with --no-deps, with the environment's workarounds: integrations/vllm-omni/
# setup_env.sh), rebuilt when that file changes, and dattn's wheel (make wheel) installed into it
# anew each time; then the real-engine suite (tests/vllm_omni, pytest in that environment).
VLLM_OMNI_VENV := .venv-vllm-omni
VLLM_OMNI_REQUIREMENTS := requirements-vllm-omni.txt
VLLM_OMNI_STAMP := $(VLLM_OMNI_VENV)/.dattn-requirements.sha256
vllm-omni-env: wheel
	@sum="$$(sha256sum $(VLLM_OMNI_REQUIREMENTS) integrations/vllm-omni/setup_env.sh \
	  integrations/vllm-omni/torch_ext_shim.py | sha256sum | cut -d' ' -f1)"; \
	if [ "$$(cat $(VLLM_OMNI_STAMP) 2>/dev/null)" != "$$sum" ]; then \
	  echo "dattn: building $(VLLM_OMNI_VENV) from $(VLLM_OMNI_REQUIREMENTS)"; \
	  rm -rf $(VLLM_OMNI_VENV) && \
	  VENV_PYTHON=$(VENV_PYTHON) integrations/vllm-omni/setup_env.sh $(VLLM_OMNI_VENV) \
	    $$(ls $(WHEEL_DIR)/dattn-*.whl) && echo "$$sum" > $(VLLM_OMNI_STAMP); \
	else \
	  $(VLLM_OMNI_VENV)/bin/python -m pip install -q --no-deps --force-reinstall \
	    $$(ls $(WHEEL_DIR)/dattn-*.whl); \
	fi

# Two pytest-xdist workers: each engine process spends most of its ~12 s importing vLLM on one
# core; the tests that share a TORCH_SDPA run are one group (tests/vllm_omni/test_engine.py).
vllm-omni-check: vllm-omni-env
	cd /tmp && DATTN_REQUIRE_ENGINE=1 $(CURDIR)/$(VLLM_OMNI_VENV)/bin/python -m pytest -q \
	  -p no:cacheprovider -n 2 --dist loadgroup --durations=0 $(CURDIR)/tests/vllm_omni

# ComfyUI (not on PyPI: a checkout of its repository, COMFYUI_DIR) imported as a library in
# .venv with requirements-comfyui.txt added (--no-deps), dattn's wheel, and the suite
# tests/comfyui: ComfyUI's own models, sampler and custom-node loader with dattn's override and
# node pack (integrations/comfyui). Without COMFYUI_DIR it says why it skipped.
COMFYUI_DIR ?=
comfyui-check: wheel
	@if [ -z "$(COMFYUI_DIR)" ]; then \
	  echo "dattn: SKIPPED comfyui-check: COMFYUI_DIR is not set (a ComfyUI checkout: ComfyUI is not on PyPI; make comfyui-check COMFYUI_DIR=/path/to/ComfyUI)"; \
	  exit 0; \
	fi; \
	$(PY) -m pip install -q --no-deps -r requirements-comfyui.txt && \
	cd /tmp && COMFYUI_DIR=$(abspath $(COMFYUI_DIR)) $(PY) -m pytest -q -p no:cacheprovider \
	  $(CURDIR)/tests/comfyui

clean:
	rm -rf build out

# Also the Python environments (the next make recreates them).
distclean: clean
	rm -rf $(VENV) $(VLLM_OMNI_VENV)
