# dattn quick start: `make run` and `make test` work on a fresh Debian machine.
# They install the Debian packages that are missing, configure, build, then run.

PRESET ?= release
BUILD := build/$(PRESET)
PREFIX ?= $(CURDIR)/out/install
DATTN := build/release/tools/dattn/dattn

# What the build needs from Debian (libgomp, OpenMP's runtime, comes with g++). The Python
# package is built and tested for /usr/bin/python3, the interpreter Debian's python3-* serve.
DEBIAN_PACKAGES := cmake ninja-build g++ make pkg-config clang-format \
  libgtest-dev libgmock-dev libcli11-dev nlohmann-json3-dev libdlpack-dev libpng-dev \
  libopenmpi-dev openmpi-bin \
  python3 python3-dev python3-pybind11 pybind11-dev python3-numpy python3-pytest python3-torch
PYTHON := /usr/bin/python3

# What `make fuzz` needs besides: clang with libFuzzer (compiler-rt) and LLVM's OpenMP runtime.
FUZZ_DEBIAN_PACKAGES := clang libclang-rt-14-dev libomp-dev
FUZZ_SECONDS ?= 45
FUZZ_TARGETS := fuzz_safetensors fuzz_attend_meta

.PHONY: deps configure build run test asan fuzz format format-check install install-check clean

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

$(BUILD)/build.ninja:
	cmake --preset $(PRESET)

configure: deps $(BUILD)/build.ninja

build: configure
	cmake --build --preset $(PRESET)

run: build
	$(BUILD)/tools/dattn/dattn run

# CTest, then the Python suite (pytest under /usr/bin/python3, importing dattn from the build
# tree). The sanitizer build has no Python module (a sanitized extension would need the runtime
# preloaded into the interpreter), so there the Python suite is skipped with a message.
test: build
	ctest --preset $(PRESET)
	@if [ -f $(BUILD)/python/dattn/__init__.py ]; then \
	  echo "dattn: Python tests ($(PYTHON) -m pytest tests/python)"; \
	  PYTHONPATH=$(CURDIR)/$(BUILD)/python $(PYTHON) -m pytest -q -p no:cacheprovider tests/python; \
	else \
	  echo "dattn: SKIPPED the Python tests: no Python module in $(BUILD) (sanitizer build or no pybind11)"; \
	fi

# The whole suite under AddressSanitizer + UndefinedBehaviorSanitizer.
asan:
	$(MAKE) test PRESET=asan

# The libFuzzer targets of tests/fuzz (clang, ASan + UBSan, build/fuzz), each run for
# FUZZ_SECONDS from its seed corpus (tests/fuzz/corpus/<target>); new inputs go to
# build/fuzz/corpus/<target>, crashing ones to build/fuzz/artifacts/. Fails on any finding.
fuzz:
	$(MAKE) deps DEBIAN_PACKAGES="$(DEBIAN_PACKAGES) $(FUZZ_DEBIAN_PACKAGES)"
	cmake --preset fuzz
	cmake --build --preset fuzz
	@for t in $(FUZZ_TARGETS); do \
	  mkdir -p build/fuzz/corpus/$$t build/fuzz/artifacts && \
	  echo "dattn: fuzzing $$t for $(FUZZ_SECONDS) s" && \
	  build/fuzz/tests/fuzz/$$t -max_total_time=$(FUZZ_SECONDS) -timeout=10 \
	    -dict=tests/fuzz/json.dict -print_final_stats=1 \
	    -artifact_prefix=build/fuzz/artifacts/$$t- build/fuzz/corpus/$$t tests/fuzz/corpus/$$t \
	    || exit 1; \
	done

format:
	git ls-files '*.cpp' '*.hpp' | xargs clang-format -i

format-check: deps
	git ls-files '*.cpp' '*.hpp' | xargs clang-format --dry-run --Werror

install: build
	cmake --install $(BUILD) --prefix $(PREFIX)

# Installs into a scratch prefix and builds examples/consumer against it, once through
# find_package(dattn) and once through pkg-config; then imports the installed Python package.
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
	cd /tmp && PYTHONPATH=$$(ls -d $(CURDIR)/out/install-check/prefix/lib/python3*/dist-packages) \
	  $(PYTHON) -c "import dattn, numpy; print('installed dattn', dattn.__file__, \
	    dattn.Attention(num_heads=1, head_size=8).forward(*[numpy.ones((1, 3, 1, 8), numpy.float32)] * 3).shape)"

clean:
	rm -rf build out
