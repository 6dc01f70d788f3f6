# Smoke test of the dattn command-line tool.
# Usage: cmake -DDATTN=<path to dattn> -DWORKDIR=<scratch dir> -P cli_smoke.cmake
# Everything it writes goes under WORKDIR.
cmake_minimum_required(VERSION 3.25)

if(NOT DATTN OR NOT WORKDIR)
  message(FATAL_ERROR "usage: cmake -DDATTN=<dattn> -DWORKDIR=<dir> -P cli_smoke.cmake")
endif()
file(REMOVE_RECURSE "${WORKDIR}")
file(MAKE_DIRECTORY "${WORKDIR}")

# Runs dattn with ARGN; sets <prefix>_RC, <prefix>_OUT (stdout) and <prefix>_ERR (stderr).
function(run_dattn prefix)
  execute_process(COMMAND "${DATTN}" ${ARGN}
                  WORKING_DIRECTORY "${WORKDIR}"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  set(${prefix}_RC "${rc}" PARENT_SCOPE)
  set(${prefix}_OUT "${out}" PARENT_SCOPE)
  set(${prefix}_ERR "${err}" PARENT_SCOPE)
endfunction()

function(expect_success prefix what)
  if(NOT "${${prefix}_RC}" STREQUAL "0")
    message(FATAL_ERROR "${what} exited with ${${prefix}_RC}\n"
                        "stdout:\n${${prefix}_OUT}\nstderr:\n${${prefix}_ERR}")
  endif()
endfunction()

function(expect_failure prefix what)
  if("${${prefix}_RC}" STREQUAL "0")
    message(FATAL_ERROR "${what} should have failed but exited with 0\n"
                        "stdout:\n${${prefix}_OUT}\nstderr:\n${${prefix}_ERR}")
  endif()
endfunction()

# ---- dattn info --json: a backends array whose entries carry the capability flags ----
run_dattn(INFO info --json)
expect_success(INFO "dattn info --json")
string(JSON backend_type ERROR_VARIABLE json_error TYPE "${INFO_OUT}" backends)
if(json_error OR NOT backend_type STREQUAL "ARRAY")
  message(FATAL_ERROR "dattn info --json has no backends array (${json_error}):\n${INFO_OUT}")
endif()
string(JSON backend_count LENGTH "${INFO_OUT}" backends)
if(backend_count LESS 1)
  message(FATAL_ERROR "dattn info --json lists no backends:\n${INFO_OUT}")
endif()
foreach(key name supports_paged_kv)
  string(JSON value ERROR_VARIABLE json_error GET "${INFO_OUT}" backends 0 ${key})
  if(json_error)
    message(FATAL_ERROR "backends[0] has no '${key}': ${json_error}\n${INFO_OUT}")
  endif()
endforeach()

# ---- dattn info --json: FLASH's engines, portable first and available ----
string(JSON engine_type ERROR_VARIABLE json_error TYPE "${INFO_OUT}" engines)
if(json_error OR NOT engine_type STREQUAL "ARRAY")
  message(FATAL_ERROR "dattn info --json has no engines array (${json_error}):\n${INFO_OUT}")
endif()
string(JSON engine0 GET "${INFO_OUT}" engines 0 name)
string(JSON engine0_available GET "${INFO_OUT}" engines 0 available)
if(NOT engine0 STREQUAL "portable" OR NOT engine0_available)
  message(FATAL_ERROR "engines[0] is not an available portable engine:\n${INFO_OUT}")
endif()

# ---- dattn run --json: the default workload, checked against REFERENCE ----
run_dattn(RUN run --json)
expect_success(RUN "dattn run --json")
foreach(key backend workload dtype threads seconds gflops peak_gflops efficiency max_abs_err
            max_rel_err)
  string(JSON value ERROR_VARIABLE json_error GET "${RUN_OUT}" ${key})
  if(json_error)
    message(FATAL_ERROR "dattn run --json has no '${key}': ${json_error}\n${RUN_OUT}")
  endif()
endforeach()
string(JSON max_rel_err GET "${RUN_OUT}" max_rel_err)
string(JSON rel_err_type TYPE "${RUN_OUT}" max_rel_err)
# if(LESS) compares numbers as doubles ("1.5e-07" included).
if(NOT rel_err_type STREQUAL "NUMBER" OR NOT max_rel_err LESS 1e-3)
  message(FATAL_ERROR "max_rel_err = ${max_rel_err} is not a number below 1e-3\n${RUN_OUT}")
endif()
message(STATUS "dattn run --json: ${RUN_OUT}")

# ---- --threads above the limit (1024): a usage error naming it, not a crash in OpenMP ----
foreach(command run bench info)
  run_dattn(THREADS ${command} --threads 100000)
  expect_failure(THREADS "dattn ${command} --threads 100000")
  if(NOT THREADS_RC EQUAL 2 OR NOT "${THREADS_OUT}${THREADS_ERR}" MATCHES "1024")
    message(FATAL_ERROR "dattn ${command} --threads 100000 exited with ${THREADS_RC}, without "
                        "the limit 1024:\n${THREADS_OUT}${THREADS_ERR}")
  endif()
endforeach()

# ---- dattn run --workload nope: usage error listing the workloads ----
run_dattn(NOPE run --workload nope)
expect_failure(NOPE "dattn run --workload nope")
foreach(name small flux-1024 wan-480p packed-docs)
  if(NOT "${NOPE_OUT}${NOPE_ERR}" MATCHES "${name}")
    message(FATAL_ERROR "dattn run --workload nope does not list workload '${name}':\n"
                        "${NOPE_OUT}${NOPE_ERR}")
  endif()
endforeach()

# ---- dattn attend on the tool's own example inputs ----
set(example "${WORKDIR}/example.safetensors")
set(example_meta "${WORKDIR}/example.meta.json")
set(result "${WORKDIR}/result.safetensors")
run_dattn(EXAMPLE attend --example-inputs "${example}")
expect_success(EXAMPLE "dattn attend --example-inputs")
if(NOT EXISTS "${example}" OR NOT EXISTS "${example_meta}")
  message(FATAL_ERROR "dattn attend --example-inputs did not write ${example} and ${example_meta}")
endif()
run_dattn(ATTEND attend --inputs "${example}" --meta "${example_meta}" --out "${result}")
expect_success(ATTEND "dattn attend")
if(NOT EXISTS "${result}")
  message(FATAL_ERROR "dattn attend did not write ${result}:\n${ATTEND_OUT}${ATTEND_ERR}")
endif()

# ---- dattn attend past the file size limit: exit 1 naming the reason; the old output stays ----
file(SHA256 "${result}" result_before)
execute_process(COMMAND sh -c "ulimit -f 8 && exec \"$0\" \"$@\"" "${DATTN}" attend
                        --inputs "${example}" --meta "${example_meta}" --out "${result}"
                WORKING_DIRECTORY "${WORKDIR}"
                RESULT_VARIABLE full_rc OUTPUT_VARIABLE full_out ERROR_VARIABLE full_err)
if(NOT full_rc STREQUAL "1" OR NOT full_err MATCHES "result\\.safetensors.*File too large")
  message(FATAL_ERROR "dattn attend under ulimit -f should exit 1 with 'File too large', got "
                      "'${full_rc}':\n${full_out}${full_err}")
endif()
file(SHA256 "${result}" result_after)
file(GLOB leftovers "${result}.tmp*")
if(NOT result_after STREQUAL result_before OR leftovers)
  message(FATAL_ERROR "a failed dattn attend changed ${result} or left ${leftovers}")
endif()

# ---- dattn attend on a malformed file: a clear error, exit 1 ----
set(malformed "${WORKDIR}/not-safetensors.txt")
file(WRITE "${malformed}" "this is not a safetensors file\n")
run_dattn(BAD attend --inputs "${malformed}" --out "${WORKDIR}/never.safetensors")
expect_failure(BAD "dattn attend on a text file")
if(NOT BAD_ERR MATCHES "^error: .*not-safetensors\\.txt")
  message(FATAL_ERROR "dattn attend on a text file should print 'error: <path>: ...', got:\n"
                      "${BAD_ERR}")
endif()
if(EXISTS "${WORKDIR}/never.safetensors")
  message(FATAL_ERROR "dattn attend wrote an output for malformed inputs")
endif()

# ---- dattn attend with an unknown META key: error naming the key ----
file(WRITE "${WORKDIR}/bad.meta.json" "{\"causal\": false, \"casual\": true}\n")
run_dattn(BADMETA attend --inputs "${example}" --meta "${WORKDIR}/bad.meta.json"
          --out "${WORKDIR}/never.safetensors")
expect_failure(BADMETA "dattn attend with an unknown META key")
if(NOT BADMETA_ERR MATCHES "casual" OR NOT BADMETA_ERR MATCHES "softmax_scale")
  message(FATAL_ERROR "an unknown META key should be named with the valid keys, got:\n"
                      "${BADMETA_ERR}")
endif()

# ---- dattn bench: one JSON line per combination, and an SVG chart ----
run_dattn(BENCH bench --workload small --backend flash --backend reference --reps 1
          --check-rows 4 --json --svg "${WORKDIR}/bench.svg")
expect_success(BENCH "dattn bench")
string(REGEX MATCHALL "\"backend\":\"[A-Z]+\"" bench_backends "${BENCH_OUT}")
if(NOT bench_backends STREQUAL "\"backend\":\"FLASH\";\"backend\":\"REFERENCE\"")
  message(FATAL_ERROR "dattn bench --json should print a FLASH and a REFERENCE line, got:\n"
                      "${BENCH_OUT}")
endif()
file(READ "${WORKDIR}/bench.svg" bench_svg)
if(NOT bench_svg MATCHES "^<svg" OR NOT bench_svg MATCHES "FLASH")
  message(FATAL_ERROR "dattn bench --svg wrote no chart")
endif()

message(STATUS "cli_smoke: all checks passed")

# ---- VIDEO_SPARSE on a small video: sparsity, errors against its mask and dense, a PNG ----
run_dattn(SPARSE run --workload video-small --backend video_sparse --sparsity 0.75 --json
          --mask-png blocks.png)
expect_success(SPARSE "dattn run --backend video_sparse")
foreach(key block_sparsity dense_rel_err max_rel_err selection_seconds)
  string(JSON value ERROR_VARIABLE json_error GET "${SPARSE_OUT}" ${key})
  if(json_error OR NOT value GREATER 0)
    message(FATAL_ERROR "dattn run --backend video_sparse: '${key}' = '${value}' ${json_error}\n"
                        "${SPARSE_OUT}")
  endif()
endforeach()
string(JSON sparse_err GET "${SPARSE_OUT}" max_rel_err)
if(NOT sparse_err LESS 1e-4)
  message(FATAL_ERROR "VIDEO_SPARSE differs from REFERENCE under its block mask:\n${SPARSE_OUT}")
endif()
file(READ "${WORKDIR}/blocks.png" png_head LIMIT 8 HEX)
if(NOT png_head STREQUAL "89504e470d0a1a0a")
  message(FATAL_ERROR "--mask-png did not write a PNG (${png_head})")
endif()
# The sliding tile window through dattn bench: a sparse row with its sparsity.
run_dattn(WINDOW bench --workload video-small --backend video_sparse --window 3,3,3 --reps 1)
expect_success(WINDOW "dattn bench --backend video_sparse --window 3,3,3")
if(NOT WINDOW_OUT MATCHES "VIDEO_SPARSE.*%")
  message(FATAL_ERROR "dattn bench --window prints no sparse row:\n${WINDOW_OUT}")
endif()

# ---- paged runs: int8 pages through forward_paged, and the prefix-reuse workload ----
run_dattn(PAGED run --workload video-small --paged 16 --kv-dtype int8 --json)
expect_success(PAGED "dattn run --paged 16 --kv-dtype int8")
string(JSON page_block GET "${PAGED_OUT}" page_block)
string(JSON kv_err GET "${PAGED_OUT}" kv_rel_err)
string(JSON kv_bytes GET "${PAGED_OUT}" kv_cache_bytes)
string(JSON f32_bytes GET "${PAGED_OUT}" kv_f32_bytes)
if(NOT page_block EQUAL 16 OR NOT kv_err LESS 0.05 OR NOT kv_bytes LESS f32_bytes)
  message(FATAL_ERROR "dattn run --paged --kv-dtype int8 reports wrong figures:\n${PAGED_OUT}")
endif()
run_dattn(REUSE run --workload prefix-reuse --heads 1 --json)
expect_success(REUSE "dattn run --workload prefix-reuse")
string(JSON reuse_err GET "${REUSE_OUT}" max_rel_err)
string(JSON recompute GET "${REUSE_OUT}" recompute_seconds)
if(NOT reuse_err LESS 1e-5 OR NOT recompute GREATER 0)
  message(FATAL_ERROR "prefix-reuse steps differ from the recomputed rows:\n${REUSE_OUT}")
endif()

# ---- sequence parallelism: bytes per strategy, and a ring over two processes ----
run_dattn(TRAFFIC traffic --workload flux-1024 --ranks 2,4 --json)
expect_success(TRAFFIC "dattn traffic")
string(REGEX MATCHALL "[^\n]+" traffic_lines "${TRAFFIC_OUT}")
list(LENGTH traffic_lines traffic_count)
if(NOT traffic_count EQUAL 7)  # P=2: ulysses, ring, allgather; P=4: the same and hybrid:2x2
  message(FATAL_ERROR "dattn traffic --ranks 2,4 prints ${traffic_count} rows:\n${TRAFFIC_OUT}")
endif()
list(GET traffic_lines 3 ulysses4)
list(GET traffic_lines 4 ring4)
string(JSON u4 GET "${ulysses4}" bytes_per_rank)
string(JSON r4 GET "${ring4}" bytes_per_rank)
if(NOT u4 GREATER 0 OR NOT r4 GREATER u4)  # at P=4 the ring moves more than Ulysses
  message(FATAL_ERROR "dattn traffic: unexpected bytes:\n${TRAFFIC_OUT}")
endif()
run_dattn(BADPAR run --parallel spiral)
expect_failure(BADPAR "dattn run --parallel spiral")
if(MPIEXEC)
  set(ENV{ASAN_OPTIONS} "detect_leaks=0")  # OpenMPI's own allocations outlive main
  execute_process(COMMAND "${MPIEXEC}" -n 2 --oversubscribe "${DATTN}" run --workload small
                          --parallel ring --threads 1 --json
                  WORKING_DIRECTORY "${WORKDIR}"
                  RESULT_VARIABLE par_rc OUTPUT_VARIABLE par_out ERROR_VARIABLE par_err)
  if(NOT par_rc EQUAL 0)
    message(FATAL_ERROR "mpiexec -n 2 dattn run --parallel ring exited with ${par_rc}\n"
                        "stdout:\n${par_out}\nstderr:\n${par_err}")
  endif()
  string(JSON par_ranks GET "${par_out}" ranks)
  string(JSON par_name GET "${par_out}" parallel)
  string(JSON par_err_value GET "${par_out}" max_rel_err)
  if(NOT par_ranks EQUAL 2 OR NOT par_name STREQUAL "ring" OR NOT par_err_value LESS 1e-5)
    message(FATAL_ERROR "dattn run --parallel ring over 2 ranks reports:\n${par_out}")
  endif()
endif()
