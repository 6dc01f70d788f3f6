# The process's configuration through the environment, as a user mistypes it: DATTN_ISA names no
# engine (an error naming the variable, never a silent fall-through to REFERENCE),
# OMP_NUM_THREADS beyond OpenMP's int (the one thread bound decides), and a peak measurement
# asked for more threads than the process may run on (measured on the CPUs it has).
# Usage: cmake -DDATTN=<path to dattn> -P cli_config.cmake
cmake_minimum_required(VERSION 3.25)

# Runs `dattn ARGN` with the environment assignment ENV; sets <prefix>_RC, _OUT and _ERR.
function(run_env prefix env)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env "${env}" "${DATTN}" ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  set(${prefix}_RC "${rc}" PARENT_SCOPE)
  set(${prefix}_OUT "${out}" PARENT_SCOPE)
  set(${prefix}_ERR "${err}" PARENT_SCOPE)
endfunction()

# ---- DATTN_ISA: an unknown name is an error naming DATTN_ISA and listing the engines ----
string(REPEAT "x" 5000 long)
foreach(value "junk" "amx,avx2" "${long}")
  run_env(ISA "DATTN_ISA=${value}" run --reps 1)
  string(SUBSTRING "${value}" 0 20 shown)
  if("${ISA_RC}" STREQUAL "0" OR NOT ISA_ERR MATCHES "DATTN_ISA" OR
     NOT ISA_ERR MATCHES "portable, portable_int8, neon, neon_dotprod, neon_dotprod_emulated, avx2")
    message(FATAL_ERROR "DATTN_ISA='${shown}...': expected an error naming DATTN_ISA and the "
                        "engines, got ${ISA_RC}\nstdout:\n${ISA_OUT}\nstderr:\n${ISA_ERR}")
  endif()
  if(ISA_OUT MATCHES "REFERENCE")
    message(FATAL_ERROR "DATTN_ISA='${shown}...' ran on REFERENCE:\n${ISA_OUT}")
  endif()
  string(LENGTH "${ISA_ERR}" err_length)
  if(err_length GREATER 1024)
    message(FATAL_ERROR "the error quotes the whole ${long} value: ${err_length} characters")
  endif()
endforeach()
# Case and surrounding whitespace are ignored: ' PORTABLE\n' is the portable engine.
run_env(ISA "DATTN_ISA= PORTABLE\n" run --reps 1 --json)
if(NOT "${ISA_RC}" STREQUAL "0" OR NOT ISA_OUT MATCHES "\"engine\":\"portable\"")
  message(FATAL_ERROR "DATTN_ISA=' PORTABLE\\n' should run on portable: ${ISA_RC}\n"
                      "${ISA_OUT}\n${ISA_ERR}")
endif()
# REFERENCE has no engines and ignores DATTN_ISA.
run_env(ISA "DATTN_ISA=junk" run --backend reference --reps 1)
if(NOT "${ISA_RC}" STREQUAL "0")
  message(FATAL_ERROR "REFERENCE should ignore DATTN_ISA: ${ISA_RC}\n${ISA_OUT}\n${ISA_ERR}")
endif()

# ---- DATTN_CPU_FEATURES: a class masks the CPU (applied before DATTN_ISA); junk is an error ----
run_env(MASK "DATTN_CPU_FEATURES=portable" run --reps 1 --json)
if(NOT "${MASK_RC}" STREQUAL "0" OR NOT MASK_OUT MATCHES "\"engine\":\"portable\"")
  message(FATAL_ERROR "DATTN_CPU_FEATURES=portable should run on portable: ${MASK_RC}\n"
                      "${MASK_OUT}\n${MASK_ERR}")
endif()
run_env(MASK "DATTN_CPU_FEATURES=avx2" info --json)
if(NOT "${MASK_RC}" STREQUAL "0" OR MASK_OUT MATCHES "\"features\":\\[[^]]*avx512" OR
   NOT MASK_OUT MATCHES "\"feature_mask\":\"avx2\"")
  message(FATAL_ERROR "DATTN_CPU_FEATURES=avx2 info should list no AVX-512 feature: ${MASK_RC}\n"
                      "${MASK_OUT}\n${MASK_ERR}")
endif()
foreach(value "junk" "avx2;avx512" "${long}")
  run_env(MASK "DATTN_CPU_FEATURES=${value}" run --reps 1)
  string(SUBSTRING "${value}" 0 20 shown)
  string(LENGTH "${MASK_ERR}" err_length)
  if(NOT "${MASK_RC}" STREQUAL "2" OR NOT MASK_ERR MATCHES "DATTN_CPU_FEATURES" OR
     NOT MASK_ERR MATCHES "portable avx2" OR err_length GREATER 1024)
    message(FATAL_ERROR "DATTN_CPU_FEATURES='${shown}...': expected a usage error (2) naming the "
                        "variable and the classes, got ${MASK_RC}\n${MASK_OUT}\n${MASK_ERR}")
  endif()
endforeach()

# ---- OMP_NUM_THREADS beyond OpenMP's int counts as the bound (1024), parsed by dattn ----
foreach(value "2147483648" "4294967298" "5000" "2147483648,2")
  run_env(THREADS "OMP_NUM_THREADS=${value}" info --json)
  string(JSON threads ERROR_VARIABLE json_error GET "${THREADS_OUT}" threads)
  if(json_error OR NOT threads EQUAL 1024)
    message(FATAL_ERROR "OMP_NUM_THREADS=${value}: info says threads ${threads} (want 1024)\n"
                        "${THREADS_OUT}\n${THREADS_ERR}")
  endif()
endforeach()
run_env(THREADS "OMP_NUM_THREADS=3,2" info --json)
string(JSON threads GET "${THREADS_OUT}" threads)
if(NOT threads EQUAL 3)
  message(FATAL_ERROR "OMP_NUM_THREADS=3,2: info says threads ${threads} (want 3)")
endif()
# Every OpenMP region of the CLI, its workload generator included, runs within the bound.
run_env(THREADS "OMP_NUM_THREADS=2147483648" run --dtype bf16 --reps 1)
if(NOT "${THREADS_RC}" STREQUAL "0")
  message(FATAL_ERROR "OMP_NUM_THREADS=2147483648 dattn run --dtype bf16: ${THREADS_RC}\n"
                      "${THREADS_OUT}\n${THREADS_ERR}")
endif()

# ---- peaks: at most as many threads as the process may run on, timed as one team ----
execute_process(COMMAND nproc OUTPUT_VARIABLE cpus OUTPUT_STRIP_TRAILING_WHITESPACE)
math(EXPR more "${cpus} + 2")
run_env(PEAK "DATTN_UNUSED=1" info --json --threads ${more})
string(JSON peak_threads GET "${PEAK_OUT}" peak_gflops threads)
string(JSON affinity GET "${PEAK_OUT}" peak_gflops affinity_cpus)
if(peak_threads GREATER cpus OR NOT affinity EQUAL cpus)
  message(FATAL_ERROR "info --threads ${more} on ${cpus} CPUs measured on ${peak_threads} "
                      "threads (affinity_cpus ${affinity})\n${PEAK_OUT}")
endif()
run_env(PEAK "DATTN_UNUSED=1" info --threads ${more})
if(NOT PEAK_OUT MATCHES "timed together over one interval, at most the ${cpus} CPU")
  message(FATAL_ERROR "info does not say how its peaks were timed:\n${PEAK_OUT}")
endif()
message(STATUS "cli_config: DATTN_ISA, OMP_NUM_THREADS and peak threads as documented")
