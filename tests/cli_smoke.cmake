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

# ---- dattn info: every kind of peak, measured or "none" with the reason ----
string(JSON f32_peak_type TYPE "${INFO_OUT}" peak_gflops f32_fma)
if(NOT f32_peak_type STREQUAL "NUMBER")
  message(FATAL_ERROR "dattn info --json: peak_gflops.f32_fma is not a number:\n${INFO_OUT}")
endif()
foreach(kind bf16_dot amx_bf16 int8_dot amx_int8)
  string(JSON kind_type ERROR_VARIABLE json_error TYPE "${INFO_OUT}" peak_gflops ${kind})
  string(JSON why_type ERROR_VARIABLE why_error TYPE "${INFO_OUT}" peak_gflops
         ${kind}_unavailable)
  # Either a measured rate, or null with the reason it is absent.
  if(json_error OR why_error OR NOT ((kind_type STREQUAL "NUMBER" AND why_type STREQUAL "NULL")
                                     OR (kind_type STREQUAL "NULL" AND why_type STREQUAL "STRING")))
    message(FATAL_ERROR "dattn info --json: peak_gflops.${kind} (${kind_type}) and "
                        "${kind}_unavailable (${why_type}) disagree:\n${INFO_OUT}")
  endif()
endforeach()
string(JSON engine0_peak GET "${INFO_OUT}" engines 0 peak_kind)
if(NOT engine0_peak STREQUAL "f32_fma")
  message(FATAL_ERROR "dattn info --json: the portable engine's peak_kind is '${engine0_peak}'")
endif()
run_dattn(INFOTEXT info --threads 1)
expect_success(INFOTEXT "dattn info")
foreach(kind "f32 FMA" "bf16 dot \\(vdpbf16ps\\)" "AMX tiles \\(tdpbf16ps\\)")
  if(NOT INFOTEXT_OUT MATCHES " (none|[0-9.]+) ${kind}")
    message(FATAL_ERROR "dattn info does not list the ${kind} peak:\n${INFOTEXT_OUT}")
  endif()
endforeach()

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

# ---- the engine that computed a run, and efficiency against that engine's peak ----
# Runs `small` (one head, 2 rows checked) with ARGN; sets <prefix>_OUT to its JSON line and
# checks engine and peak_kind ("null" for none, in which case efficiency must be null too).
function(expect_engine prefix engine peak_kind)
  run_dattn(${prefix} run --workload small --heads 1 --reps 1 --check-rows 2 --json ${ARGN})
  expect_success(${prefix} "dattn run ${ARGN}")
  set(out "${${prefix}_OUT}")
  string(JSON got_engine GET "${out}" engine)
  string(JSON got_kind_type TYPE "${out}" peak_kind)
  string(JSON got_kind GET "${out}" peak_kind)
  string(JSON eff_type TYPE "${out}" efficiency)
  string(JSON peak_type TYPE "${out}" peak_gflops)
  if(peak_kind STREQUAL "null")
    set(ok FALSE)
    if(got_kind_type STREQUAL "NULL" AND eff_type STREQUAL "NULL" AND peak_type STREQUAL "NULL")
      set(ok TRUE)
    endif()
  else()
    set(ok FALSE)
    if(got_kind STREQUAL "${peak_kind}" AND eff_type STREQUAL "NUMBER"
       AND peak_type STREQUAL "NUMBER")
      set(ok TRUE)
    endif()
  endif()
  if(NOT got_engine STREQUAL "${engine}" OR NOT ok)
    message(FATAL_ERROR "dattn run ${ARGN}: expected engine ${engine} with peak_kind "
                        "${peak_kind}, got:\n${out}")
  endif()
endfunction()
# avx2 where this CPU runs it (info's engines[1]), else portable: an f32 engine, held to the
# f32 FMA peak.
string(JSON engine1 GET "${INFO_OUT}" engines 1 name)
string(JSON engine1_available GET "${INFO_OUT}" engines 1 available)
set(f32_engine portable)
if(engine1 STREQUAL "avx2" AND engine1_available)
  set(f32_engine avx2)
endif()
expect_engine(ISA_F32 ${f32_engine} f32_fma --isa ${f32_engine})
# Emulated engines get no peak and no efficiency: bf16 inputs, and f32 inputs with
# --compute-dtype bf16.
expect_engine(ISA_EMU avx512_bf16_emulated null --dtype bf16 --isa avx512_bf16_emulated)
expect_engine(ISA_EMU_F32 avx512_bf16_emulated null --compute-dtype bf16
              --isa avx512_bf16_emulated)
# REFERENCE has no engine, hence no peak.
expect_engine(REF_ENGINE "" null --backend reference)
# The bench table names the engine and prints '-' for the missing peak; the chart names it.
run_dattn(BENCH_EMU bench --workload small --heads 1 --reps 1 --check-rows 2 --dtype bf16
          --isa avx512_bf16_emulated --svg "${WORKDIR}/bench_emulated.svg")
expect_success(BENCH_EMU "dattn bench --isa avx512_bf16_emulated")
if(NOT BENCH_EMU_OUT MATCHES "engine" OR
   NOT BENCH_EMU_OUT MATCHES "FLASH +bf16 +avx512_bf16_emulated +[0-9]+ +[0-9.]+ +[0-9.]+ +- ")
  message(FATAL_ERROR "dattn bench --isa avx512_bf16_emulated: no engine column or a peak "
                      "where there is none:\n${BENCH_EMU_OUT}")
endif()
file(READ "${WORKDIR}/bench_emulated.svg" emu_svg)
if(NOT emu_svg MATCHES "FLASH bf16 \\(avx512_bf16_emulated\\)" OR NOT emu_svg MATCHES ">n/a<")
  message(FATAL_ERROR "dattn bench --svg does not name the engine or marks a peak:\n${emu_svg}")
endif()
# Bad values: a usage error naming the option; engine options on a backend without engines:
# an error naming the option.
foreach(bad "--isa;sse9" "--compute-dtype;f64" "--pv-dtype;f64")
  list(GET bad 0 option)
  run_dattn(BADOPT run --workload small --heads 1 ${bad})
  if(NOT BADOPT_RC EQUAL 2 OR NOT "${BADOPT_OUT}${BADOPT_ERR}" MATCHES "${option}")
    message(FATAL_ERROR "dattn run ${bad} exited with ${BADOPT_RC}, without naming ${option}:\n"
                        "${BADOPT_OUT}${BADOPT_ERR}")
  endif()
endforeach()
# SAGE with P.V in 8 bits (--pv-dtype int8) runs and names an int8 engine.
run_dattn(PV8 run --workload small --heads 1 --backend sage --pv-dtype int8 --json)
expect_success(PV8 "dattn run --backend sage --pv-dtype int8")
if(NOT PV8_OUT MATCHES "\"peak_kind\": *\"int8_dot\"")
  message(FATAL_ERROR "dattn run --backend sage --pv-dtype int8: not on an int8 engine:\n"
                      "${PV8_OUT}")
endif()
# bench rows with their own backend options: NAME:key=value,... (SAGE with and without 8-bit
# P.V in one run); a spec without key=value names --backend.
run_dattn(SPECS bench --workload small --heads 1 --reps 1 --check-rows 0 -b sage
          -b sage:pv_dtype=int8,smooth_k=false --json)
expect_success(SPECS "dattn bench -b sage -b sage:pv_dtype=int8,smooth_k=false")
if(NOT SPECS_OUT MATCHES "\"backend_options\": *\"pv_dtype=int8,smooth_k=false\"")
  message(FATAL_ERROR "dattn bench -b sage:pv_dtype=int8: no backend_options in its row:\n"
                      "${SPECS_OUT}")
endif()
run_dattn(BADSPEC bench --workload small --heads 1 --reps 1 -b sage:pv_dtype)
if(BADSPEC_RC EQUAL 0 OR NOT "${BADSPEC_OUT}${BADSPEC_ERR}" MATCHES "key=value")
  message(FATAL_ERROR "dattn bench -b sage:pv_dtype should fail naming key=value:\n"
                      "${BADSPEC_OUT}${BADSPEC_ERR}")
endif()
run_dattn(BADBACKEND bench --workload small --heads 1 --backend reference --isa portable)
if(NOT BADBACKEND_RC EQUAL 1 OR NOT BADBACKEND_ERR MATCHES "--isa.*REFERENCE|--isa.*reference")
  message(FATAL_ERROR "dattn bench --backend reference --isa portable should fail naming --isa:"
                      "\n${BADBACKEND_OUT}${BADBACKEND_ERR}")
endif()

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
string(JSON sparse_engine GET "${SPARSE_OUT}" engine)
if(NOT sparse_err LESS 1e-4 OR sparse_engine STREQUAL "")
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
string(JSON paged_engine GET "${PAGED_OUT}" engine)  # planned inside FLASH's forward_paged
if(NOT page_block EQUAL 16 OR NOT kv_err LESS 0.05 OR NOT kv_bytes LESS f32_bytes
   OR paged_engine STREQUAL "")
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
  string(JSON par_engine GET "${par_out}" engine)
  if(NOT par_ranks EQUAL 2 OR NOT par_name STREQUAL "ring" OR NOT par_err_value LESS 1e-5
     OR par_engine STREQUAL "")
    message(FATAL_ERROR "dattn run --parallel ring over 2 ranks reports:\n${par_out}")
  endif()
endif()
