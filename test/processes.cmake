# The tests that start processes: several ranks (distributed), a CUDA device (gpu), and runs killed or stopped and
# resumed (resume). Included by test/CMakeLists.txt.

# One helper per kind of test that starts processes, so that none is registered without its label, timeout and lock:
#   volt_distributed_test(name command...)  several ranks on the 2 cores: label distributed, 120 s, the `cores` lock
#   volt_resume_test(name [CORES] command...)  a run killed or stopped and resumed: label resume, 300 s, MISMATCH fails
#                                              it; CORES where it runs several ranks at once (the `cores` lock)
#   volt_gpu_test(name command...)  needs a CUDA device: label gpu, skipped (77) without one, 300 s, the `gpu` lock
set(volt_oversubscribe "OMPI_MCA_rmaps_base_oversubscribe=1")
function(volt_distributed_test name)
  add_test(NAME ${name} COMMAND ${ARGN})
  set_tests_properties(${name} PROPERTIES LABELS distributed TIMEOUT 120 RESOURCE_LOCK cores
                       ENVIRONMENT ${volt_oversubscribe})
endfunction()
function(volt_resume_test name)
  set(lock "")
  set(command ${ARGN})
  if(ARGV1 STREQUAL "CORES")
    set(lock RESOURCE_LOCK cores)
    list(REMOVE_AT command 0)
  endif()
  add_test(NAME ${name} COMMAND ${command})
  set_tests_properties(${name} PROPERTIES LABELS resume TIMEOUT 300 FAIL_REGULAR_EXPRESSION "MISMATCH"
                       ENVIRONMENT ${volt_oversubscribe} ${lock})
endfunction()
function(volt_gpu_test name)
  add_test(NAME ${name} COMMAND ${ARGN})
  set_tests_properties(${name} PROPERTIES LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 300 RESOURCE_LOCK gpu
                       ENVIRONMENT ${volt_oversubscribe})
endfunction()

# Multi-process tests: 2 ranks on 2 cores, through mpirun, Script's self-relaunch and Spawn.
add_executable(distributed distributed.cpp)
volt_own_target(distributed OPTIMIZATION "${VOLT_TESTS_OPTIMIZATION}")
target_precompile_headers(distributed PRIVATE <torch/torch.h>)
if(VOLT_NCCL_FOUND)  # gpu-ddp: DDP over NCCL on the GPU host
  target_link_libraries(distributed PRIVATE volt::nccl)
endif()
set(dist $<TARGET_FILE:distributed>)
volt_distributed_test(dist.fit.mpirun ${volt_mpirun} ${dist} fit script)
volt_distributed_test(dist.fit.mpirun_accumulate ${volt_mpirun} ${dist} fit script --accumulate 3)
volt_distributed_test(dist.fit.script_relaunch ${dist} fit script)
volt_distributed_test(dist.fit.spawn ${dist} fit spawn)
volt_distributed_test(dist.fit.spawn_accumulate ${dist} fit spawn --accumulate 2)
volt_distributed_test(dist.fit.mpirun_fused ${volt_mpirun} ${dist} fit script --fused)
volt_distributed_test(dist.fit.spawn_fused ${dist} fit spawn --fused)
volt_distributed_test(dist.fit.mpirun_ema ${volt_mpirun} ${dist} fit script --accumulate 2 --ema 0.8)
volt_distributed_test(dist.fit.spawn_ema ${dist} fit spawn --ema 0.8)
volt_distributed_test(dist.max_time.mpirun ${volt_mpirun} ${dist} max-time)
volt_distributed_test(dist.manual.mpirun ${volt_mpirun} ${dist} manual script)
volt_distributed_test(dist.manual.spawn ${dist} manual spawn)
volt_distributed_test(dist.placement.script_relaunch ${dist} placement script)
volt_distributed_test(dist.placement.spawn ${dist} placement spawn)
volt_distributed_test(dist.placement.spawn_omp3 ${dist} placement spawn 3)
volt_distributed_test(dist.indices.mpirun ${volt_mpirun} ${dist} indices script 48)
volt_distributed_test(dist.indices.mpirun_padded ${volt_mpirun} ${dist} indices script 47)
volt_distributed_test(dist.indices.script_relaunch ${dist} indices script 48)
volt_distributed_test(dist.indices.spawn ${dist} indices spawn 47)
volt_distributed_test(dist.metrics.mpirun ${volt_mpirun} ${dist} metrics)
volt_distributed_test(dist.profiler.mpirun ${volt_mpirun} ${dist} profiler)
volt_distributed_test(dist.checkpointing.mpirun ${volt_mpirun} ${dist} checkpointing)
volt_distributed_test(dist.weighted_loss.mpirun ${volt_mpirun} ${dist} weighted-loss)
volt_distributed_test(dist.manual_refusals.mpirun ${volt_mpirun} ${dist} manual-refusals)
# Clipping by norm under Fp64True on 2 ranks: float64-exact against one process (the norm's squares summed in float64).
foreach(kind ddp zero1 zero2 fsdp model-parallel)
  volt_distributed_test(dist.clip_fp64.${kind} ${volt_mpirun} ${dist} clip-fp64 ${kind})
endforeach()
# Units run in another order on rank 1 than on rank 0 in the first step: refused on both ranks, naming call and ranks.
foreach(kind fsdp model-parallel)
  volt_distributed_test(dist.${kind}.unit_order_refused ${dist} expect-failure 60
    "on rank 0: volt: the ranks ran different units in the fit's first step: unit call 1 ran unit 0 on rank 0 and unit 2 on rank 1"
    "on rank 1: volt: the ranks ran different units in the fit's first step: unit call 1 ran unit 0 on rank 0 and unit 2 on rank 1"
    -- ${volt_mpirun} ${dist} unit-order ${kind})
endforeach()
volt_distributed_test(dist.fsdp.weigh_loss_refused ${dist} expect-failure 60 "set_sync_every_micro_batch(false) to accumulate them locally" -- ${volt_mpirun} ${dist} fsdp-weigh-loss)
volt_distributed_test(dist.manual_weigh_loss_refused ${dist} expect-failure 60 "weigh_loss under a strategy whose ranks hold different parts" -- ${volt_mpirun} ${dist} manual-weigh-loss)
volt_distributed_test(dist.legacy_checkpoint.mpirun ${volt_mpirun} ${dist} legacy-checkpoint resume
                      ${CMAKE_CURRENT_SOURCE_DIR}/data/legacy)
# Files of the last commit before the plain pickle and PyTorch's optimizer state_dict (test/data/legacy-4936e33/).
volt_distributed_test(dist.legacy_checkpoint.4936e33 ${volt_mpirun} ${dist} legacy-checkpoint resume
                      ${CMAKE_CURRENT_SOURCE_DIR}/data/legacy-4936e33)
# Files of the last commit before the sharded form's pieces became boxes (format 2), sharded folders among them
# (test/data/legacy-cf3012f/).
volt_distributed_test(dist.legacy_checkpoint.cf3012f ${volt_mpirun} ${dist} legacy-checkpoint resume
                      ${CMAKE_CURRENT_SOURCE_DIR}/data/legacy-cf3012f sharded)
volt_distributed_test(dist.metrics.mixed_options ${dist} expect-failure 30 "was logged with other options" -- ${volt_mpirun} ${dist} metrics-mixed)
volt_distributed_test(dist.collectives.mpirun3 ${VOLT_MPIEXEC} --allow-run-as-root --oversubscribe -np 3 ${dist} collectives)
# A process mesh on 4 ranks: collectives and sends along each axis; a peer killed (or stalled) during a receive ends
# every rank with RankFailure naming it (mpirun's --enable-recovery leaves the survivors to end by themselves).
volt_distributed_test(dist.mesh.mpirun4 ${VOLT_MPIEXEC} --allow-run-as-root --oversubscribe -np 4 ${dist} mesh)
volt_distributed_test(dist.mesh.peer_killed ${dist} expect-failure 40 "rank 0 ended with RankFailure naming rank 3"
  "rank 1 ended with RankFailure naming rank 3" "rank 2 ended with RankFailure naming rank 3" "killed or crashed"
  --any-status -- ${VOLT_MPIEXEC} --allow-run-as-root --oversubscribe --enable-recovery -np 4 ${dist} mesh-fault die)
volt_distributed_test(dist.mesh.peer_stalled ${dist} expect-failure 40 "for receive #" "from rank 3 on axis tensor"
  "Its peer: rank 3 on" -- ${VOLT_MPIEXEC} --allow-run-as-root --oversubscribe -np 4 ${dist} mesh-fault stall --timeout 3)
# ZeRO against a one-process loop: each stage, optimizer, world size (2, 4) and launch (mpirun, self-relaunch) once.
set(mpirun4 ${VOLT_MPIEXEC} --allow-run-as-root --oversubscribe -np 4)
volt_distributed_test(dist.zero.mpirun2_stage1_sgd ${volt_mpirun} ${dist} zero script 1 2 sgd)
volt_distributed_test(dist.zero.mpirun2_stage2_adam ${volt_mpirun} ${dist} zero script 2 2 adam)
volt_distributed_test(dist.zero.mpirun4_stage1_adam ${mpirun4} ${dist} zero script 1 4 adam)
volt_distributed_test(dist.zero.mpirun4_stage2_sgd ${mpirun4} ${dist} zero script 2 4 sgd)
volt_distributed_test(dist.zero.relaunch2_stage1_adam ${dist} zero script 1 2 adam)
volt_distributed_test(dist.zero.relaunch2_stage2_sgd ${dist} zero script 2 2 sgd)
volt_distributed_test(dist.zero.relaunch4_stage1_sgd ${dist} zero script 1 4 sgd)
volt_distributed_test(dist.zero.relaunch4_stage2_adam ${dist} zero script 2 4 adam)
volt_distributed_test(dist.zero.spawn2_stage2_adam ${dist} zero spawn 2 2 adam)
volt_distributed_test(dist.zero.mpirun2_stage2_fused ${volt_mpirun} ${dist} zero script 2 2 fused-adam)
volt_distributed_test(dist.fsdp.mpirun2_reshard ${volt_mpirun} ${dist} fsdp script 2 reshard)
volt_distributed_test(dist.fsdp.mpirun3_keep ${VOLT_MPIEXEC} --allow-run-as-root --oversubscribe -np 3 ${dist} fsdp script 3 keep)
volt_distributed_test(dist.fsdp.mpirun4_checkpointing ${mpirun4} ${dist} fsdp script 4 reshard checkpointing)
volt_distributed_test(dist.fsdp.spawn2 ${dist} fsdp spawn 2 reshard)
# Bf16Mixed: the units gathered in bfloat16 from float32 pieces, against a one-process bfloat16 reference.
volt_distributed_test(dist.fsdp.mpirun2_bf16 ${volt_mpirun} ${dist} fsdp script 2 reshard bf16)
volt_distributed_test(dist.fsdp.mpirun3_keep_bf16 ${VOLT_MPIEXEC} --allow-run-as-root --oversubscribe -np 3 ${dist} fsdp script 3 keep checkpointing bf16)
# Every collective started late (collective_thread.hpp): a missing wait or a buffer freed early shows.
volt_distributed_test(dist.fsdp.mpirun2_delayed ${volt_mpirun} -x VOLT_COLLECTIVE_DELAY_US=3000 ${dist} fsdp script 2 reshard)
volt_distributed_test(dist.fsdp.mpirun4_delayed_bf16 ${mpirun4} -x VOLT_COLLECTIVE_DELAY_US=2000 ${dist} fsdp script 4 keep bf16)
volt_distributed_test(dist.fsdp.gpt_mpirun2 ${volt_mpirun} ${dist} fsdp-gpt 2 reshard)
# Units declared in configure_model: laid out as the fit starts (the first step sharded), at 3 ranks (no unit divides);
# a rank declaring another order refused on every rank, naming the call, the units and the ranks.
volt_distributed_test(dist.fsdp.declared_mpirun3 ${VOLT_MPIEXEC} --allow-run-as-root --oversubscribe -np 3 ${dist} fsdp-declared 3)
volt_distributed_test(dist.fsdp.declared_order_refused ${dist} expect-failure 60
  "volt: the ranks declared different units in configure_model: declared unit 2 is unit 0 on ranks 0 and 2 and unit 1 on rank 1"
  -- ${VOLT_MPIEXEC} --allow-run-as-root --oversubscribe -np 3 ${dist} fsdp-declared 3 1)
# FSDP at world size 1 against SingleDevice (Bf16Mixed), its sharded checkpoint against its full file (gpu.fsdp on the
# CPU)
volt_distributed_test(dist.fsdp.world_one ${dist} fsdp-world-one)
volt_distributed_test(dist.fsdp.gpt_mpirun3_keep ${VOLT_MPIEXEC} --allow-run-as-root --oversubscribe -np 3 ${dist} fsdp-gpt 3 keep)
volt_distributed_test(dist.predict.mpirun2 ${volt_mpirun} ${dist} predict script 2)
volt_distributed_test(dist.predict.mpirun3 ${VOLT_MPIEXEC} --allow-run-as-root --oversubscribe -np 3 ${dist} predict script 3)
volt_distributed_test(dist.predict.spawn3 ${dist} predict spawn 3)
volt_distributed_test(dist.zero.mpirun2_stage1_inf ${volt_mpirun} ${dist} zero-inf 1)
volt_distributed_test(dist.zero.mpirun2_stage2_inf ${volt_mpirun} ${dist} zero-inf 2)
volt_distributed_test(dist.zero.unfreeze_refused ${dist} expect-failure 60 "started to require gradients during a sharded (ZeRO) fit" -- ${volt_mpirun} ${dist} zero-unfreeze)
volt_distributed_test(dist.fail.mpirun ${dist} expect-failure 30 "boom at step 3 on rank 1" -- ${volt_mpirun} ${dist} fail script 1 3)
volt_distributed_test(dist.fail.mpirun_rank0 ${dist} expect-failure 30 "boom at step 2 on rank 0" -- ${volt_mpirun} ${dist} fail script 0 2)
volt_distributed_test(dist.fail.script_relaunch ${dist} expect-failure 30 "boom at step 3 on rank 1" -- ${dist} fail script 1 3)
volt_distributed_test(dist.fail.spawn ${dist} expect-failure 30 "boom at step 3 on rank 1" -- ${dist} fail spawn 1 3)
# A rank alive but stalled (120 s) at step 3 with a 3 s collective timeout: rank 0 says who had not joined
volt_distributed_test(dist.fail.timeout ${dist} expect-failure 30 "had not issued it: rank 1 on" --
         ${volt_mpirun} ${dist} fail script 1 3 stall --timeout 3)
set_tests_properties(dist.placement.spawn_omp3 PROPERTIES  # the job's own OMP_NUM_THREADS reaches the workers
  ENVIRONMENT "OMPI_MCA_rmaps_base_oversubscribe=1;OMP_NUM_THREADS=3")
# DDP over NCCL at world size 1 against SingleDevice, Bf16Mixed, on the GPU (skipped where CUDA or NCCL is missing).
volt_gpu_test(gpu.ddp_script ${dist} gpu-ddp script)
volt_gpu_test(gpu.ddp_spawn ${dist} gpu-ddp spawn)
volt_gpu_test(gpu.zero_script ${dist} gpu-zero script)
volt_gpu_test(gpu.mesh ${dist} gpu-mesh)
volt_gpu_test(gpu.fsdp ${dist} gpu-fsdp)  # its CPU twin: dist.fsdp.world_one
volt_gpu_test(gpu.model_parallel ${dist} gpu-model-parallel)  # its CPU twin: dist.model_parallel.world_one
set_tests_properties(gpu PROPERTIES RESOURCE_LOCK gpu)

# Resuming in new processes: SIGKILL at a random step, kills during writes, 2 ranks, N -> M ranks, Python.
add_executable(resume resume.cpp)
volt_own_target(resume OPTIMIZATION "${VOLT_TESTS_OPTIMIZATION}")
target_precompile_headers(resume REUSE_FROM distributed)
target_precompile_headers(volt_static_tests REUSE_FROM distributed)  # the same definitions (volt::nccl where found)
if(VOLT_NCCL_FOUND)  # the same definitions as distributed, whose precompiled header it reuses
  target_link_libraries(resume PRIVATE volt::nccl)
endif()
set(resume_exe $<TARGET_FILE:resume>)
set(resume_dir ${CMAKE_CURRENT_BINARY_DIR}/resume_runs)
volt_resume_test(resume.sigkill ${resume_exe} sigkill ${resume_dir}/sigkill 3)
volt_resume_test(resume.sigkill_manual ${resume_exe} sigkill ${resume_dir}/sigkill_manual 3 manual)
volt_resume_test(resume.sigkill_workers ${resume_exe} sigkill ${resume_dir}/sigkill_workers 3 workers)
volt_resume_test(resume.sigkill_async ${resume_exe} sigkill ${resume_dir}/sigkill_async 4 async)
volt_resume_test(resume.sigkill_tokens ${resume_exe} sigkill ${resume_dir}/sigkill_tokens 3 tokens)
volt_resume_test(resume.kill_mid_write ${resume_exe} kill-mid-write ${resume_dir}/kill_mid_write 8)
volt_resume_test(resume.ddp_exact CORES ${resume_exe} ddp-exact ${resume_dir}/ddp_exact -- ${volt_mpirun})
volt_resume_test(resume.fsdp_exact CORES ${resume_exe} fsdp-exact ${resume_dir}/fsdp_exact -- ${volt_mpirun})
volt_resume_test(resume.fsdp_sharded_exact CORES ${resume_exe} fsdp-sharded-exact ${resume_dir}/fsdp_sharded_exact --
                 ${volt_mpirun})
volt_resume_test(resume.file_ops_kill CORES ${resume_exe} file-ops-kill ${resume_dir}/file_ops_kill -- ${volt_mpirun})
set_tests_properties(resume.file_ops_kill PROPERTIES TIMEOUT 900)
volt_resume_test(resume.sharded_kill CORES ${resume_exe} sharded-kill ${resume_dir}/sharded_kill 3 -- ${volt_mpirun})
volt_resume_test(resume.spawn_exact CORES ${resume_exe} spawn-exact ${resume_dir}/spawn_exact)
volt_resume_test(resume.two_to_one CORES ${resume_exe} n-to-m 2 1 ${resume_dir}/two_to_one -- ${volt_mpirun})
volt_resume_test(resume.one_to_two CORES ${resume_exe} n-to-m 1 2 ${resume_dir}/one_to_two -- ${volt_mpirun})
volt_resume_test(resume.two_to_two CORES ${resume_exe} n-to-m 2 2 ${resume_dir}/two_to_two -- ${volt_mpirun})
volt_resume_test(resume.zero CORES ${resume_exe} zero-resume ${resume_dir}/zero -- ${volt_mpirun})
volt_resume_test(resume.fsdp CORES ${resume_exe} fsdp-resume ${resume_dir}/fsdp -- ${volt_mpirun})
# Stop signals: SIGTERM to one process, to mpirun and to a Spawn main process; SIGUSR1 to one of 2 ranks.
volt_resume_test(resume.signal_single ${resume_exe} signal single ${resume_dir}/signal_single)
volt_resume_test(resume.signal_mpirun CORES ${resume_exe} signal mpirun-term ${resume_dir}/signal_mpirun -- ${volt_mpirun})
volt_resume_test(resume.signal_one_rank CORES ${resume_exe} signal usr1-one-rank ${resume_dir}/signal_one_rank -- ${volt_mpirun})
volt_resume_test(resume.signal_spawn CORES ${resume_exe} signal spawn ${resume_dir}/signal_spawn)
# A Python whose torch reads our checkpoint: VOLT_PYTHON if given, else the one that belongs to the LibTorch found
# (pip's torch lives in a Python environment), else Debian's /usr/bin/python3, else python3 on PATH.
set(volt_python_candidates ${VOLT_PYTHON})
if(TORCH_INSTALL_PREFIX MATCHES "^(.*)/lib/python[0-9.]+/site-packages/torch$")
  list(APPEND volt_python_candidates ${CMAKE_MATCH_1}/bin/python3)
endif()
find_program(volt_path_python3 NAMES python3)
list(APPEND volt_python_candidates /usr/bin/python3 ${volt_path_python3})
set(volt_torch_python "")
foreach(py IN LISTS volt_python_candidates)
  if(EXISTS "${py}")
    execute_process(COMMAND "${py}" -c "import torch" RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
    if(rc EQUAL 0)
      set(volt_torch_python "${py}")
      break()
    endif()
  endif()
endforeach()
if(volt_torch_python)
  message(STATUS "volt: the tests that read volt's files with Python's torch use ${volt_torch_python}")
endif()
# A test whose command ends in `<python with torch> <script> <args>` (skipped, 77, where there is no such Python);
# it fails on "MISMATCH".
function(volt_torch_python_test name before script)
  if(volt_torch_python)
    add_test(NAME ${name} COMMAND sh -c "${before} && '${volt_torch_python}' '${CMAKE_CURRENT_SOURCE_DIR}/${script}' ${ARGN}")
  else()
    add_test(NAME ${name}
             COMMAND sh -c "echo 'no Python with torch was found (tried: ${volt_python_candidates}); set VOLT_PYTHON or install python3-torch. Skipped.'; exit 77")
    set_tests_properties(${name} PROPERTIES SKIP_RETURN_CODE 77)
  endif()
  set_tests_properties(${name} PROPERTIES TIMEOUT 300 FAIL_REGULAR_EXPRESSION "MISMATCH" SKIP_RETURN_CODE 77)
endfunction()
# This line's files, just written, and each LibTorch line's committed ones (test/data/torch_load/).
volt_torch_python_test(resume.torch_load "'${resume_exe}' export '${resume_dir}/python'" torch_load_check.py
                       "'${resume_dir}/python' '${CMAKE_CURRENT_SOURCE_DIR}/data/torch_load/torch1.13' '${CMAKE_CURRENT_SOURCE_DIR}/data/torch_load/torch2.11'")
set_tests_properties(resume.torch_load PROPERTIES LABELS resume)
# Hyper-parameters (test/hparams_check.py): a fit's configuration and its module's own, read back from its checkpoints
# by Python's torch (weights_only) and from its loggers' folder by PyYAML and tensorboard.
if(VOLT_TOOLS_PYTHON)
  set(volt_hparams_logs "&& '${VOLT_TOOLS_PYTHON}' '${CMAKE_CURRENT_SOURCE_DIR}/hparams_check.py' logs '${resume_dir}/hparams'")
else()
  set(volt_hparams_logs "&& echo 'no Python with tensorboard and PyYAML (scripts/install-python-tools.sh): the loggers' files were not read'")
endif()
volt_torch_python_test(hparams.python
                       "VOLT_HPARAMS_DIR='${resume_dir}/hparams' '$<TARGET_FILE:volt_tests>' '[.hparams_export]'"
                       hparams_check.py "checkpoints '${resume_dir}/hparams' ${volt_hparams_logs}")
if(VOLT_TOOLS_PYTHON)
  set_tests_properties(hparams.python PROPERTIES PASS_REGULAR_EXPRESSION "hparams ok: hparams.yaml")
endif()
# Token files (test/tokens_check.py): NumPy writes a nanoGPT .bin and .npy files of five types, volt's TokenLoader reads
# them (tiled and random windows, two epochs, two ranks), and every window is checked against NumPy's slice of the file.
volt_torch_python_test(data.tokens_numpy
                       "rm -rf '${resume_dir}/tokens' && '${volt_torch_python}' '${CMAKE_CURRENT_SOURCE_DIR}/tokens_check.py' write '${resume_dir}/tokens' && VOLT_TOKENS_DIR='${resume_dir}/tokens' '$<TARGET_FILE:volt_tests>' '[.tokens_export]'"
                       tokens_check.py "compare '${resume_dir}/tokens'")
set_tests_properties(data.tokens_numpy PROPERTIES PASS_REGULAR_EXPRESSION "tokens ok")
# GPT-2 between volt's GPT and transformers (test/gpt2_check.py): transformers saves a GPT-2 of random weights (one file
# and shards), volt loads both with equal logits and exports its own, which from_pretrained loads with equal logits.
# transformers needs torch 2: the 2.11 lane runs it, the 1.13 lane skips it.
volt_torch_python_test(weights.gpt2_transformers
                       "export HF_HUB_OFFLINE=1 && rm -rf '${resume_dir}/gpt2' && '${volt_torch_python}' '${CMAKE_CURRENT_SOURCE_DIR}/gpt2_check.py' write '${resume_dir}/gpt2' && VOLT_GPT2_DIR='${resume_dir}/gpt2' '$<TARGET_FILE:volt_tests>' '[.gpt2]'"
                       gpt2_check.py "compare '${resume_dir}/gpt2'")
set_tests_properties(weights.gpt2_transformers PROPERTIES PASS_REGULAR_EXPRESSION "gpt2 ok")
# The transformer recipe (AdamW with two parameter groups, warm-up then cosine, stepped per optimizer step) trained by
# volt and by PyTorch from the same weights and batches (test/recipe_check.py): the same rates and weights.
volt_torch_python_test(optim.recipe_vs_torch
                       "rm -rf '${resume_dir}/recipe' && VOLT_EXPORT_DIR='${resume_dir}/recipe' '$<TARGET_FILE:volt_tests>' '[recipe_export]'"
                       recipe_check.py "'${resume_dir}/recipe'")
# safetensors both ways (test/safetensors_check.py): Python's safetensors and torch read volt's files (every dtype,
# the same bytes as Python's writer, a network's weights giving the same output) and write files volt reads back.
volt_torch_python_test(weights.safetensors_python
                       "rm -rf '${resume_dir}/safetensors' && VOLT_EXPORT_DIR='${resume_dir}/safetensors' '$<TARGET_FILE:volt_tests>' '[safetensors_export]'"
                       safetensors_check.py "'${resume_dir}/safetensors' && VOLT_EXPORT_DIR='${resume_dir}/safetensors' '$<TARGET_FILE:volt_tests>' '[safetensors_import]'")
# ModelParallel (configure_model's parts on a mesh) against a one-process loop: hybrid sharding on a 2x2 mesh with its
# checkpoint resumed under it and DDP; a 1x1 mesh on one rank against SingleDevice; two sharded parts on one axis of 3
# ranks.
volt_distributed_test(dist.model_parallel.mpirun4_hsdp ${mpirun4} ${dist} model-parallel 4 hsdp)
# A mesh of three axes, the third of the tensor role: ranks along it share batches; sync_dist and gradients over the
# data axes only.
volt_distributed_test(dist.model_parallel.mpirun4_mesh_roles ${mpirun4} ${dist} mesh-roles)
volt_distributed_test(dist.model_parallel.tensor_axis_refused ${dist} expect-failure 60
                      "configure_model shards \"blocks\" along the axis \"tensor\", whose role is tensor"
                      -- ${mpirun4} ${dist} mesh-roles refused)
volt_distributed_test(dist.model_parallel.world_one ${dist} model-parallel-world-one)
volt_distributed_test(dist.model_parallel.weigh_loss_refused ${dist} expect-failure 60 "under ModelParallel, which reduce-scatters each micro-batch" -- ${volt_mpirun} ${dist} model-parallel-weigh-loss)
volt_distributed_test(dist.model_parallel.mpirun3_two_parts ${VOLT_MPIEXEC} --allow-run-as-root --oversubscribe -np 3 ${dist} model-parallel 3 two-parts)
