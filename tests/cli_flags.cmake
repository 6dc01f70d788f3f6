# The command line as a careless user types it (issue 52): a flag that no chosen backend takes
# is an error naming the flag (never silently ignored); a count out of range says the real
# range; an absurdly long key or name is quoted by its start and end; `traffic` with an unknown
# workload prints no table; a key given twice in attend's META is an error.
# Usage: cmake -DDATTN=<path to dattn> -DWORKDIR=<scratch dir> -P cli_flags.cmake
cmake_minimum_required(VERSION 3.25)
file(MAKE_DIRECTORY "${WORKDIR}")

function(run_dattn prefix)
  execute_process(COMMAND "${DATTN}" ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  set(${prefix}_RC "${rc}" PARENT_SCOPE)
  set(${prefix}_OUT "${out}" PARENT_SCOPE)
  set(${prefix}_ERR "${err}" PARENT_SCOPE)
endfunction()

# Fails unless `dattn ARGN` exits non-zero with stderr matching `pattern` and writes no report.
function(expect_refused pattern)
  run_dattn(R ${ARGN})
  string(REPLACE ";" " " shown "${ARGN}")
  if("${R_RC}" STREQUAL "0" OR NOT R_ERR MATCHES "${pattern}" OR R_OUT MATCHES "GFLOP")
    message(FATAL_ERROR "dattn ${shown}: expected a refusal matching '${pattern}', got rc "
                        "${R_RC}\nstdout:\n${R_OUT}\nstderr:\n${R_ERR}")
  endif()
endfunction()

# ---- flags that only some backends take, with a backend that does not ----
set(png "${WORKDIR}/never.png")
file(REMOVE "${png}")
expect_refused("--mask-png.*FLASH.*VIDEO_SPARSE" run -b flash --heads 1 --mask-png "${png}")
if(EXISTS "${png}")
  message(FATAL_ERROR "--mask-png with FLASH wrote ${png}")
endif()
expect_refused("--sparsity.*VIDEO_SPARSE" run -b flash --heads 1 --sparsity 0.5)
expect_refused("--topk.*VIDEO_SPARSE" run -b sage --heads 1 --topk 3)
expect_refused("--window.*VIDEO_SPARSE" run -b flash --heads 1 --window 1,1,1)
expect_refused("--tile.*VIDEO_SPARSE" run -b reference --heads 1 --tile 1,2,2)
expect_refused("--pv-dtype.*SAGE" run -b flash --heads 1 --pv-dtype int8)
expect_refused("--isa.*reference has none" run -b reference --heads 1 --isa portable)
expect_refused("--compute-dtype" run -b sage --heads 1 --compute-dtype bf16)
expect_refused("--kv-dtype.*VIDEO_SPARSE" run -b video_sparse -w video-small --heads 1
               --kv-dtype int8)
expect_refused("--paged.*VIDEO_SPARSE" run -b video_sparse -w video-small --heads 1 --paged 16)
expect_refused("--paged.*VIDEO_SPARSE" bench -b flash -b video_sparse -w video-small --heads 1
               --paged 16)
expect_refused("--page-dtype.*--paged" run --heads 1 --page-dtype bf16)
# ... and with one that takes them, they run.
run_dattn(OK run -b video_sparse -w video-small --heads 1 --sparsity 0.5 --check-rows 2
          --mask-png "${png}")
if(NOT "${OK_RC}" STREQUAL "0" OR NOT EXISTS "${png}")
  message(FATAL_ERROR "VIDEO_SPARSE with --sparsity and --mask-png: rc ${OK_RC}\n${OK_ERR}")
endif()

# ---- counts out of range: the real range, not CLI11's float bounds ----
foreach(bad "run;--reps;0;1 to 1000000" "run;--heads;0;1 to 4096" "traffic;--ranks;0;1 to 65536"
            "bench;--reps;-3;1 to 1000000" "run;--check-rows;-1;0 to 2147483647"
            "run;--threads;0;1 to 1024" "run;--paged;0;1 to 1048576" "run;--topk;x;1 to")
  list(GET bad 0 command)
  list(GET bad 1 flag)
  list(GET bad 2 value)
  list(GET bad 3 range)
  run_dattn(C ${command} ${flag} ${value})
  string(LENGTH "${C_ERR}" length)
  if(NOT "${C_RC}" STREQUAL "2" OR NOT C_ERR MATCHES "${flag}: ${value} is not valid; want ${range}"
     OR length GREATER 200)
    message(FATAL_ERROR "dattn ${command} ${flag} ${value}: expected '${flag}: ${value} is not "
                        "valid; want ${range}', got rc ${C_RC}:\n${C_ERR}")
  endif()
endforeach()

# ---- a 100 kB key, backend, workload or value is quoted by its start and end ----
string(REPEAT "k" 100000 long)
foreach(args "run;-b;flash:${long}=1" "run;-b;${long}" "run;-w;${long}" "run;--isa;${long}"
             "run;-b;sage:pv_dtype=${long}" "run;--dtype;${long}" "run;--${long};1"
             "traffic;-w;${long}")
  run_dattn(L ${args})
  string(LENGTH "${L_ERR}" length)
  list(GET args 1 flag)
  if("${L_RC}" STREQUAL "0" OR length GREATER 3000 OR length EQUAL 0)
    message(FATAL_ERROR "dattn ... ${flag} <100 kB>: rc ${L_RC}, ${length} characters of error")
  endif()
endforeach()

# ---- traffic: an unknown workload is refused before any table is printed ----
run_dattn(T traffic -w flux-1024 -w nope)
if(NOT "${T_RC}" STREQUAL "2" OR NOT T_OUT STREQUAL "" OR NOT T_ERR MATCHES "unknown workload 'nope'")
  message(FATAL_ERROR "traffic -w nope: rc ${T_RC}\nstdout:\n${T_OUT}\nstderr:\n${T_ERR}")
endif()

# ---- attend: a key given twice in META, at the top and inside extra ----
run_dattn(EX attend --example-inputs "${WORKDIR}/ex.safetensors")
if(NOT "${EX_RC}" STREQUAL "0")
  message(FATAL_ERROR "attend --example-inputs: ${EX_ERR}")
endif()
foreach(meta "{\"causal\": true, \"causal\": false}"
             "{\"extra\": {\"valid_kv_length\": 3, \"valid_kv_length\": 4}}")
  file(WRITE "${WORKDIR}/twice.json" "${meta}")
  file(REMOVE "${WORKDIR}/out.safetensors")
  expect_refused("given twice" attend --inputs "${WORKDIR}/ex.safetensors"
                 --meta "${WORKDIR}/twice.json" --out "${WORKDIR}/out.safetensors")
  if(EXISTS "${WORKDIR}/out.safetensors")
    message(FATAL_ERROR "attend wrote its output despite META ${meta}")
  endif()
endforeach()
run_dattn(GOOD attend --inputs "${WORKDIR}/ex.safetensors" --meta "${WORKDIR}/ex.meta.json"
          --out "${WORKDIR}/out.safetensors")
if(NOT "${GOOD_RC}" STREQUAL "0")
  message(FATAL_ERROR "attend with the example META: ${GOOD_ERR}")
endif()
message(STATUS "cli_flags: all checks passed")
